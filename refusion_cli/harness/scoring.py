"""Score one generation the moment it is produced, exactly as lm-eval will score it later.

``TaskScorer(tasks, metric, filter_name)(task_name, doc, output)`` runs the named filter pipeline of
the lm-eval task on that one output, then the task's own ``process_results``, and returns the
target and the value of ``metric``. The same functions, on the same document, give the same value
lm-eval aggregates (a test checks the two agree), so the per-sample journal can say whether a
sample is correct before the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampleScore:
    target: str  # the task's reference (doc_to_target) as text
    score: float  # the metric's value for this sample (1.0 = correct for the suite's metrics)

    @property
    def correct(self) -> bool:
        return self.score >= 1.0


class TaskScorer:
    """Per-sample scoring for the tasks (and subtasks) of one benchmark."""

    def __init__(self, tasks: dict[str, Any], metric: str, filter_name: str = "none") -> None:
        self.tasks = tasks  # lm-eval task name -> Task
        self.metric = metric
        self.filter_name = filter_name
        for name, task in tasks.items():
            filters = [ensemble.name for ensemble in task._filters]
            if filter_name not in filters:
                raise ValueError(f"task {name} has no filter '{filter_name}' (it has {', '.join(filters)})")

    def __call__(self, task_name: str, doc: dict[str, Any], output: str) -> SampleScore:
        task = self.tasks[task_name]
        ensemble = next(e for e in task._filters if e.name == self.filter_name)
        responses: Any = [[output]]  # one document, one response: the shape lm-eval's filters take
        for make_filter in ensemble.filters:
            responses = make_filter().apply(responses, [doc])
        filtered = list(responses)[0]
        results = task.process_results(doc, [filtered])
        if self.metric not in results:
            raise ValueError(f"task {task_name} reports {', '.join(results)}, not {self.metric}")
        return SampleScore(target=str(task.doc_to_target(doc)), score=float(results[self.metric]))
