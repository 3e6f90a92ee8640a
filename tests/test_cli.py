"""The real path end to end: the command line on the embedded SmolLM2 model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.api import hf_generate
from specdec.hub import load_model
from specdec.verify import SamplingConfig

PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("method", ["pld", "ar"])
def test_generate_on_embedded_model_matches_transformers(method):
    proc = run_cli("generate", "--model", "smollm2", "--method", method, "--prompt", PROMPT, "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    model, tok = load_model("smollm2", "fp32")
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert out["tokens"] == hf_generate(model, list(ids), 12, SamplingConfig())
    assert out["text"] == tok.decode(out["tokens"], skip_special_tokens=True)
    assert out["stats"]["target_calls"] >= 1


def test_bench_writes_the_documented_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "category": "qa", "chat": True, "prompt": PROMPT}) + "\n")
    out = tmp_path / "r.json"
    proc = run_cli("bench", "--prompts", str(prompts), "--methods", "hf,hf-pld,ar,pld", "--max-new-tokens", "6",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert {"model", "dtype", "max_new_tokens", "threads", "torch", "transformers"} <= set(res["config"])
    run_keys = {"method", "prompt_id", "category", "new_tokens", "seconds", "target_calls", "draft_calls",
                "drafted_tokens", "accepted_tokens", "identical_to_reference"}
    assert all(run_keys <= set(r) for r in res["runs"])
    assert {r["method"] for r in res["runs"]} == {"hf", "hf-pld", "ar", "pld"}
    for m, s in res["summary"].items():
        assert {"speedup", "tokens_per_second", "tokens_per_call", "accept_rate", "identical_rate"} <= set(s)
        assert s["identical_rate"] == 1.0, m
    assert res["summary"]["hf"]["speedup"] == pytest.approx(1.0)
    assert res["summary"]["ar"]["tokens_per_call"] <= 1.0
