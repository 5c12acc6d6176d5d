"""The engine's own behaviour, beside what every decoder test checks through ``run_decoder``: a request's stop
rule ends its row at the step that committed the stop (the compute saved, the others unaffected), and a row that
cannot start fails its request alone."""

from __future__ import annotations

import torch

from refusion_cli.decoding import ARConfig, ReFusionConfig
from refusion_cli.decoding.engine import Engine, Failed, Finished, Outcome, Request, run_decoder
from refusion_cli.decoding.registry import row_options
from tests.decoding.test_batched import prompts_for
from tests.tiny import MASK_ID, tiny_qwen3


def request(decoder: str, prompt: list[int], config, outcomes: dict[int, Outcome], index: int,
            mask: int | None = MASK_ID, **fields) -> Request:
    return Request(decoder, torch.tensor(prompt), config, row_options(decoder, mask, None),
                   done=lambda outcome: outcomes.__setitem__(index, outcome),
                   generator=torch.Generator().manual_seed(index), **fields)


def test_a_stop_rule_ends_its_row_at_the_step_that_committed_the_stop():
    model, prompts = tiny_qwen3(4, init_std=0.5), prompts_for(0)
    alone = run_decoder("ar", model, prompts, ARConfig(gen_length=24), mask_token_id=None, eos_token_id=None)
    engine, outcomes = Engine(model), {}
    seen: list[int] = []

    def stop_after_five(prefix: list[int]) -> int | None:
        seen.append(len(prefix))
        return 5 if len(prefix) >= 5 else None

    for index, prompt in enumerate(prompts):
        engine.submit(request("ar", prompt, ARConfig(gen_length=24), outcomes, index,
                              stop=stop_after_five if index == 0 else None))
    engine.run()
    stopped = outcomes[0]
    assert isinstance(stopped, Finished) and stopped.stopped
    assert stopped.result.tokens == alone[0].tokens[:5] and stopped.result.stats.forwards == 5  # 19 calls saved
    assert seen == [1, 2, 3, 4, 5]  # the rule saw the committed prefix grow, a token a step, until it stopped
    for index in range(1, len(prompts)):
        other = outcomes[index]
        assert isinstance(other, Finished) and not other.stopped and other.result.tokens == alone[index].tokens


def test_a_row_that_cannot_start_fails_its_request_alone():
    model, prompts = tiny_qwen3(4, init_std=0.5), prompts_for(0)
    config = ReFusionConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.3, token_threshold=0.3)
    alone = run_decoder("refusion", model, prompts, config, mask_token_id=MASK_ID, eos_token_id=None,
                        generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))])
    engine, outcomes = Engine(model, max_rows=2), {}
    for index, prompt in enumerate(prompts):  # the second request has no mask token: ReFusion cannot plan
        engine.submit(request("refusion", prompt, config, outcomes, index, mask=None if index == 1 else MASK_ID))
    engine.run()
    failed = outcomes[1]
    assert isinstance(failed, Failed) and "mask token" in failed.message
    for index in (0, *range(2, len(prompts))):
        finished = outcomes[index]
        assert isinstance(finished, Finished) and finished.result.tokens == alone[index].tokens
    assert not engine.busy and engine.counts.peak_rows == 2


def test_after_a_call_out_of_memory_the_engine_gets_its_full_row_cap_back(monkeypatch):
    from refusion_cli.decoding.cache import CausalRunner
    from tests.memory import out_of_memory_above

    model = tiny_qwen3(4, init_std=0.5)
    prompts = prompts_for(0) * 4  # 12 requests
    config = ARConfig(gen_length=12)
    alone = [run_decoder("ar", model, prompt, config, mask_token_id=None, eos_token_id=None) for prompt in prompts]
    failed = out_of_memory_above(monkeypatch, CausalRunner, 2, times=1)  # one call of more than two rows runs out
    engine, outcomes = Engine(model, max_rows=4), {}
    rows: list[int] = []
    engine.on_call = rows.append
    for index, prompt in enumerate(prompts):
        engine.submit(request("ar", prompt, config, outcomes, index))
    engine.run()
    assert failed == [4] and engine.counts.oom_requeues == 1 and engine.counts.cap_restores == 1
    assert engine.row_cap == 4
    back = rows.index(4)  # the requeued requests ran at most 2 rows a call; once they left, 4 rows again
    assert back > 0 and max(rows[:back]) == 2
    for index in range(len(prompts)):
        outcome = outcomes[index]
        assert isinstance(outcome, Finished) and outcome.result.tokens == alone[index].tokens
