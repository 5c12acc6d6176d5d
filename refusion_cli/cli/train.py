"""`refusion train`: not available yet."""

from refusion_cli.errors import UserError


def train() -> None:
    """Not available yet in this version of the toolkit."""
    raise UserError("'refusion train' is not available yet in this version of the toolkit")
