"""`refusion bench`: not available yet."""

from refusion_cli.errors import UserError


def bench() -> None:
    """Not available yet in this version of the toolkit."""
    raise UserError("'refusion bench' is not available yet in this version of the toolkit")
