"""``adaptive-mem profile | search | run`` on every Hugging Face family: the tool chain a user
runs on a model spec, end to end, in process. The searched plan must change something and run."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")

from adaptive_mem.cli import main  # noqa: E402
from adaptive_mem.models._hf import HF_FAMILIES  # noqa: E402

SHAPE = ["--batch-size", "2", "--seq-len", "16"]


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_profile_search_run(family: str, tmp_path, capsys):
    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    spec = ["--model", f"hf:{family}", *SHAPE]
    assert main(["profile", *spec, "-o", str(profile)]) == 0
    assert main(["search", str(profile), "--activation-budget", "0.7", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", *spec, "--plan", str(plan), "--steps", "2", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "peak" in out, out
