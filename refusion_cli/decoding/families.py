"""Which model family each decoder suits: causal models for AR and ReFusion, bidirectional for MDMs.

The decoders themselves accept any model (a mismatch runs, it just decodes nonsense); the CLI
and the evaluation harness call :func:`check_decoder_fits` once, after loading the model.
"""

from __future__ import annotations

from refusion_cli.errors import UserError

# decoder name -> True when it needs a bidirectional (masked-diffusion) model, False for a causal one
NEEDS_BIDIRECTIONAL: dict[str, bool] = {
    "ar": False,
    "refusion": False,
    "llada": True,
    "dream": True,
}


def check_decoder_fits(decoder_name: str, bidirectional: bool, force: bool = False) -> None:
    """Refuse a decoder / model pairing that cannot work, unless ``force``; unknown decoders always fail."""
    if decoder_name not in NEEDS_BIDIRECTIONAL:
        raise UserError(f"unknown decoder '{decoder_name}'; choose one of {', '.join(NEEDS_BIDIRECTIONAL)}")
    needs = NEEDS_BIDIRECTIONAL[decoder_name]
    if force or needs == bidirectional:
        return
    if needs:
        raise UserError(
            f"the {decoder_name} decoder needs a bidirectional (masked-diffusion) model, but this model is causal",
            hint="use the refusion or ar decoder for a causal model",
        )
    raise UserError(
        f"the {decoder_name} decoder needs a causal model, but this model is bidirectional (masked-diffusion)",
        hint="use the llada or dream decoder for a bidirectional model",
    )
