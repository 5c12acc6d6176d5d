"""lm-eval's command line with the project's adapters registered (lm-eval has no plugin discovery).

    python -m refusion_cli.harness --model refusion --model_args pretrained=refusion-tiny,preset=gsm8k \
        --tasks gsm8k_cot --apply_chat_template --batch_size 1
"""

import refusion_cli.harness.lm_adapters  # noqa: F401  (registers refusion, ar, llada, dream)
from lm_eval.__main__ import cli_evaluate

cli_evaluate()
