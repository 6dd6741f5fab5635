"""The reward pre-flight (`fitrl.reward.probes`): its probes built as described, and its verdict, on
hand-made rewards."""

from __future__ import annotations

from fitrl.guards import Health
from fitrl.reward.probes import (
    DETAILS_KEY,
    MAX_CUT_SWING,
    Cut,
    check_probes,
    figures,
    finished,
    probe_completions,
    run_probes,
    table,
)

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


# Completions cut at a length: each has words after its last sentence end.
CUT = [" It was fine. The plot", " Good acting. I", " The score was superb. Then the", " A dull film. It"]


def test_where_a_completion_is_cut_is_measured_against_the_same_text_ended_at_its_sentence() -> None:
    assert finished(" It was fine. The plot") == " It was fine."
    assert finished(" minutes.\nAfter finding") == " minutes."
    assert finished(" It was fine. The plot was dull.") is None  # ends at a sentence end
    assert finished(" Rated 3.5 stars") is None and finished(" It was good. ...") is None  # no words after an end

    def reads_the_cut(indices: list[int], texts: list[str]) -> list[float]:  # 2 points off an unfinished text
        return [float(len(t)) / 10 - (0.0 if t.rstrip().endswith((".", "!", "?")) else 2.0) for t in texts]

    found = run_probes(reads_the_cut, ["Q"] * 4, CUT, False, False)
    scores = reads_the_cut([], CUT)
    gaps = sorted(abs(a - b) for i, a in enumerate(scores) for b in scores[i + 1 :])
    spread = (gaps[2] + gaps[3]) / 2  # the median of the six gaps
    ended = reads_the_cut([], [finished(t) for t in CUT])
    shift = sorted(abs(a - b) for a, b in zip(scores, ended))
    assert found.cut == Cut(4, 4, (shift[1] + shift[2]) / 2, spread)
    assert found.cut.swing > MAX_CUT_SWING
    health = Health()
    check_probes(found, health)
    saw = health.seen["reward_probes"]
    assert saw["passed"] is False and "cut_mid_sentence: 4 of 4 completions end mid-sentence" in saw["saw"]

    def reads_words(indices: list[int], texts: list[str]) -> list[float]:  # what the text says, not where it ends
        return [t.count("superb") + t.count("Good") - t.count("dull") for t in texts]

    calm = Health()
    check_probes(run_probes(reads_words, ["Q"] * 4, CUT, False, False), calm)
    assert (
        calm.seen["reward_probes"]["passed"] is True
        and "cut_mid_sentence swing 0%" in calm.seen["reward_probes"]["saw"]
    )

    whole = Health()  # completions that end at their sentence: the cut is not exercised, and that is said
    check_probes(run_probes(reads_the_cut, QUERIES, REFERENCES, False, False), whole)
    assert (
        whole.seen["reward_probes"]["passed"] is True
        and "0 of 2 completions end mid-sentence" in whole.seen["reward_probes"]["saw"]
    )
    assert run_probes(reads_the_cut, ["Q"], ["<answer>4</answer>"], False, True).cut is None  # a format task


def test_the_report_shows_the_pre_flight_as_a_table() -> None:
    def length(indices: list[int], texts: list[str]) -> list[float]:
        return [float(len(t.split())) for t in texts]

    details = {DETAILS_KEY: run_probes(length, ["Q"] * 4, CUT, False, False).to_json()}
    lines = table(details)
    assert lines[2:4] == ["| probe | n | mean score | share above the median reference |", "|---|---|---|---|"]
    # By hand: the references have 5, 3, 6 and 4 words (median 4.5); a ramble strings the other three
    # together (13, 15, 12, 14 words); ended at their sentence, 3, 2, 4 and 3 words: shifts 2, 1, 2, 1
    # (median 1.5), and the six gaps between two references 1, 1, 1, 2, 2, 3 (median 1.5).
    assert "| empty | 4 | 0 | 0% |" in lines and "| ramble | 4 | 13.5 | 100% |" in lines
    assert "| repeat | 4 | 8 | 100% |" in lines  # 8 words at least
    cut = next(line for line in lines if line.startswith("Where a completion is cut"))
    assert "4 of 4 end mid-sentence" in cut and "by 1.5 (median), 100% of the median gap" in cut
    assert figures(details) == [
        "reward pre-flight, most above the median reference completion: repeat 100%, ramble 100%, cut_mid_word 50%; "
        "cut_mid_sentence swing 100% (4 of 4 end mid-sentence)"
    ]
    assert table({}) == [] and figures({}) == []
