"""What the chat tests share: the question and system message they ask, and the skip for a checkout without the
embedded refusion-tiny."""

from __future__ import annotations

from refusion_cli.models.loading import embedded_path

QUESTION = "Mia has 3 apples. She buys 4 more apples. How many apples does Mia have now?"
SYSTEM = "You are a careful tutor. End every answer with #### and the number."
EMBEDDED_MISSING = not (embedded_path("refusion-tiny") / "config.json").is_file()
EMBEDDED_SKIP = "the embedded refusion-tiny is not built in this checkout (refusion_cli/assets/refusion-tiny/" \
                "config.json is missing; build it with `make models`)"
