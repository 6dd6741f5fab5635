"""GSM8K accuracy as an `evaluate` metric: the number in each completion's <answer> block vs the gold number.

    import evaluate
    metric = evaluate.load("fitrl/metrics/gsm8k_accuracy")   # a local path: no hub, works offline
    metric.compute(predictions=[["<reasoning>\\n...\\n</reasoning>\\n<answer>\\n18\\n</answer>"]], references=["18"])
    # {'accuracy': 1.0, 'pass_at_k': 1.0, 'format_compliance': 1.0, 'k': 1}

Each prediction is the list of k completions sampled for one problem (k = 1 for greedy decoding).
Numbers compare as numbers (`1,000`, `$18`, `18.0`); the parsing is `fitrl.tasks.grading`, the same code
that scores completions during GRPO training, so training reward and evaluation accuracy agree.
"""

import datasets
import evaluate

from fitrl.tasks.grading import is_correct, is_strict_format

_DESCRIPTION = "Exact numeric match between the <answer> block of a completion and GSM8K's gold answer."
_KWARGS_DESCRIPTION = """
Args:
    predictions: for each problem, a list of k completions (strings).
    references: for each problem, the gold answer (the text after '####').
Returns:
    accuracy: fraction of all completions whose answer equals the gold number (pass@1 when k = 1).
    pass_at_k: fraction of problems with at least one correct completion among their k.
    format_compliance: fraction of completions in the exact <reasoning>/<answer> format.
    k: completions per problem.
"""


class Gsm8kAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("string")), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[list[str]], references: list[str]) -> dict:
        if not predictions:
            raise ValueError("no predictions to score")
        ks = {len(p) for p in predictions}
        if len(ks) != 1 or 0 in ks:
            raise ValueError(f"every problem needs the same number (>= 1) of completions, got {sorted(ks)}")
        correct = [[is_correct(c, gold) for c in comps] for comps, gold in zip(predictions, references)]
        n = sum(len(c) for c in correct)
        return {
            "accuracy": sum(map(sum, correct)) / n,
            "pass_at_k": sum(any(c) for c in correct) / len(correct),
            "format_compliance": sum(is_strict_format(c) for comps in predictions for c in comps) / n,
            "k": ks.pop(),
        }
