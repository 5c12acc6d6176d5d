"""`refusion chat`: not available yet."""

from refusion_cli.errors import UserError


def chat() -> None:
    """Not available yet in this version of the toolkit."""
    raise UserError("'refusion chat' is not available yet in this version of the toolkit")
