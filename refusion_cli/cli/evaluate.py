"""`refusion eval`: not available yet."""

from refusion_cli.errors import UserError


def evaluate() -> None:
    """Not available yet in this version of the toolkit."""
    raise UserError("'refusion eval' is not available yet in this version of the toolkit")
