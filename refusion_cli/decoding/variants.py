"""ReFusion's decoding variants: this toolkit's ablations beside the paper's decoder (docs/algorithm.md).

A variant is a triple of flags, ``(causal_fix, causal_first, recheck)``, the keyword arguments of
``engine.run_decoder`` of those names; ``PAPER`` (all three off) is the paper's decoder. ``refusion eval``
and ``refusion bench`` ask for them with the same options (``--causal-fix``, ``--causal-first``,
``--recheck``), measure the same variants for the same options (:func:`asked_variants`) and name their
rows the same way (:func:`variant_label`).
"""

from __future__ import annotations

from typing import TypedDict

Variant = tuple[bool, bool, bool]  # (causal_fix, causal_first, recheck)

FLAGS = ("causal_fix", "causal_first", "recheck")
OPTIONS = ("--causal-fix", "--causal-first", "--recheck")  # the command-line option of each flag
PAPER: Variant = (False, False, False)
# the variants a command measures, in row order -> the label suffix of their rows
SUFFIXES: dict[Variant, str] = {(True, False, False): " (causal fix)", (False, True, False): " (causal first)",
                                (True, True, False): " (causal fix + first)", (False, False, True): " (recheck)",
                                (True, True, True): " (causal fix + first + recheck)"}


def asked_variants(causal_fix: bool, causal_first: bool, recheck: bool) -> list[Variant]:
    """The variants measured when the options of these flags are given, in row order: each one asked for,
    causal fix + first when both are, all three when all are."""
    wanted = {(True, False, False): causal_fix, (False, True, False): causal_first,
              (True, True, False): causal_fix and causal_first, (False, False, True): recheck,
              (True, True, True): causal_fix and causal_first and recheck}
    return [flags for flags in SUFFIXES if wanted[flags]]


class VariantOptions(TypedDict):
    """A variant's flags by name (``FLAGS``)."""

    causal_fix: bool
    causal_first: bool
    recheck: bool


def variant_options(flags: Variant) -> VariantOptions:
    """``engine.run_decoder``'s keyword arguments for a variant (ReFusion's ablations)."""
    causal_fix, causal_first, recheck = flags
    return VariantOptions(causal_fix=causal_fix, causal_first=causal_first, recheck=recheck)


NAMES = ("causal fix", "causal first", "recheck")  # each flag in a label


def variant_label(decoder: str, flags: Variant) -> str:
    """The decoder, and the variant ``flags`` make of it if any: "refusion", "refusion (recheck)", "ar", ...
    A mix no command measures as a row of its own (chat takes any) names its flags: "(causal first + recheck)"."""
    if not any(flags):
        return decoder
    return decoder + SUFFIXES.get(flags, " (" + " + ".join(name for name, on in zip(NAMES, flags) if on) + ")")


def first_option(causal_fix: bool, causal_first: bool, recheck: bool) -> str | None:
    """The command-line option of the first flag given (for an error that names it), None if none is."""
    return next((option for option, given in zip(OPTIONS, (causal_fix, causal_first, recheck)) if given), None)


__all__ = ["FLAGS", "NAMES", "OPTIONS", "PAPER", "SUFFIXES", "Variant", "asked_variants", "first_option",
           "variant_label", "variant_options"]
