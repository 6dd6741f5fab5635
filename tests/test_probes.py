"""The reward pre-flight (`fitrl.reward.probes`): its probes built as described, and its verdict, on
hand-made rewards."""

from __future__ import annotations

from fitrl.guards import Health
from fitrl.reward.probes import check_probes, probe_completions, run_probes

QUERIES = ["Q1", "Q2"]
REFERENCES = [" It was fine. The plot was dull.", " The acting was superb."]


def test_probes_are_built_from_the_references_as_described() -> None:
    probes = {k: [t for _, t in v] for k, v in probe_completions(QUERIES, REFERENCES, True, False).items()}
    assert probes["cut_mid_word"] == [" It was fine. The plot was du", " The acting was sup"]
    assert probes["cut_mid_sentence"] == [" It was fine. The plot", " The acting"]
    assert probes["negated"] == [" It was not fine. The plot was dull.", " The acting was not superb."]
    assert probes["repeat"][1] == " " + " ".join(["The"] * 8)  # the longest reference's 7 words, at least 8
    assert probes["echo"] == [" Q1", " Q2"] and probes["empty"] == ["", ""]
    assert probes["ramble"] == [" The acting was superb.", " It was fine. The plot was dull."]
    assert "format_only" not in probes
    formatted = probe_completions(["Q"], ["<reasoning>\n2+2\n</reasoning>\n<answer>\n4\n</answer>"], False, True)
    assert formatted["format_only"] == [(0, "<reasoning>\n</reasoning>\n<answer>\n4\n</answer>")]
    assert formatted["bare_number"] == [(0, "4")] and "negated" not in formatted


def test_a_reward_paying_for_a_degenerate_answer_fires_the_guard_and_an_honest_one_passes() -> None:
    def pays_repeats(indices: list[int], texts: list[str]) -> list[float]:
        return [float(len(t.split()) - len(set(t.split()))) for t in texts]

    found = run_probes(pays_repeats, QUERIES, REFERENCES, True, False)
    assert found.median_reference == 0.5  # the references repeat one word ("was") and none
    assert found.shares["repeat"] == 1.0 and found.shares["empty"] == 0.0
    health = Health()
    check_probes(found, health, max_share=0.8)
    assert health.seen["reward_probes"]["passed"] is False and "repeat 100%" in health.seen["reward_probes"]["saw"]

    def length(indices: list[int], texts: list[str]) -> list[float]:  # pays for saying more, nothing degenerate wins
        return [-abs(len(t.split()) - 5.5) for t in texts]

    honest = Health()
    check_probes(run_probes(length, QUERIES, REFERENCES, False, False), honest, max_share=0.8)
    assert honest.seen["reward_probes"]["passed"] is True
