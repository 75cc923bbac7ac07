"""`dagrl bench learning --vs trl --update-parity --quick`: dagrl trains 3 steps of the tiny
workload for real, TRL's GRPOTrainer (in its venv) trains on the same samples, and the two
updates are the same update: equal rewards, advantages equal up to the two sides' std epsilon
(TRL's 1e-4, verl's and ours 1e-6), gradients and the weights' change parallel to float32
rounding. A different loss turns the gradient, not only its length: dagrl with
seq-mean-token-mean aggregation gave cosines of 0.976 and 0.688 at steps 1 and 2 of this run,
without the std scaling of advantages 0.908 and 0.844, so the bounds below are far from both."""

from __future__ import annotations

import json

from benchmarks import learning


def test_dagrl_and_trl_make_the_same_update_from_the_same_samples(tmp_path, capsys):
    figures = tmp_path / "parity.json"
    assert learning.main(["--vs", "trl", "--update-parity", "--quick", "--steps", "3",
                          "--out", str(tmp_path / "run"), "--json", str(figures)]) == 0
    printed = capsys.readouterr().out
    assert "| reward dagrl / TRL |" in printed and "weights after 3 step(s)" in printed
    result = json.loads(figures.read_text())
    assert [row["step"] for row in result["steps"]] == [1, 2, 3]
    for row in result["steps"]:
        assert row["score_max_abs_diff"] < 1e-6, row
        assert row["advantage_max_abs_diff"] < 0.05, row
        ours, theirs = row["grad_norm"]
        assert theirs > 0 and abs(ours / theirs - 1) < 0.01, row
        assert row["grad_cosine"] > 0.9999, row
    change = result["weight_change"]
    assert change["cosine"] > 0.999 and abs(change["norm"][0] / change["norm"][1] - 1) < 0.01


def test_both_samplers_draw_from_the_policy(tmp_path, capsys):
    """`dagrl bench rollout --distribution --quick`: dagrl's native decoder and transformers'
    generate on the same prompts. A sampler drawing from pi has its tokens' mean -log pi equal
    to pi's mean entropy there, in expectation (3.82 against 3.83 for both on this model, from
    ~480 tokens); a greedy one would sit far below, a flat one far above."""
    from benchmarks import rollout

    figures = tmp_path / "samplers.json"
    assert rollout.main(["--distribution", "--quick", "--prompts", "16", "--out",
                         str(tmp_path / "run"), "--json", str(figures)]) == 0
    assert "| dagrl native |" in capsys.readouterr().out
    result = json.loads(figures.read_text())
    assert set(result) == {"dagrl native", "transformers generate"}
    for sampler in result.values():
        assert sampler["mean_length"] > 1
        assert abs(sampler["nll"] / sampler["entropy"] - 1) < 0.1, sampler
