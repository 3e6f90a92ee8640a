"""The method registry: options, labels, CLI flags and errors all come from one declaration per method."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from specdec import methods
from specdec.api import SpecDecoder, hf_generate
from specdec.bench import Prompt, run_bench
from specdec.cli import main
from specdec.methods import Method, option, parse_label
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of


def test_labels_parse_and_type_their_values():
    assert parse_label("sd:draft_length=2:schedule=heuristic") == ("sd", {"draft_length": "2", "schedule": "heuristic"})
    assert parse_label("ar") == ("ar", {})
    opts = methods.get("sd").parse({"draft_length": "2", "confidence": "0.5", "draft": "7"})
    assert (opts.draft_length, opts.confidence, opts.draft) == (2, 0.5, "7")  # a draft named by digits stays a name
    assert methods.get("ngrammys").parse({"c": "0"}).c == 0
    for label, err in [("sd:draft_length", "name=value"), ("sd:=3", "name=value"), ("pld:num_tokens=1:num_tokens=2", "twice")]:
        with pytest.raises(ValueError, match=err):
            parse_label(label)
    for name, given, err in [("sd", {"draft_length": "2.5"}, "must be int"), ("sd", {"schedule": "cost"}, "one of"),
                             ("sd", {"confidence": "1.5"}, r"\[0, 1\)"), ("ngrammys", {"c": "-1"}, ">= 0"),
                             ("ngrammys", {"support": "2"}, "one of"), ("pld", {"k": "3"}, "unknown options")]:
        with pytest.raises(ValueError, match=err):
            methods.get(name).parse(given)
    with pytest.raises(ValueError, match="unknown method 'medusa': choose from ar, sd, pld, ngrammys"):
        methods.get("medusa")


def test_every_option_is_documented_and_has_a_flag():
    parser_help = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--help"], capture_output=True,
                                 text=True, timeout=120).stdout
    for spec in methods.REGISTRY.values():
        assert spec.name in parser_help
        for f in spec.fields():
            assert f.metadata["help"], (spec.name, f.name)
            if f.metadata.get("cli", True):
                assert (f.metadata.get("flag") or "--" + f.name.replace("_", "-")) in parser_help, (spec.name, f.name)


def test_a_registered_method_reaches_python_cli_and_bench(tmp_path, capsys):
    """A method declared outside the package (here: pld under another name with its own option) is
    served by generate_ids, ``specdec bench`` labels and the JSON summary, keyed by the label."""

    @dataclasses.dataclass(frozen=True)
    class EchoOptions:
        length: int = option(2, "draft length", cli=False)

    def build(dec, o, sampling):
        from specdec.drafters import PromptLookupDrafter
        from specdec.policies import StaticLength
        return methods.Built(PromptLookupDrafter(o.length), StaticLength(o.length))

    methods.register(Method("echo-test", "prompt lookup, fixed length", EchoOptions, False, build))
    try:
        with pytest.raises(ValueError, match="already registered"):
            methods.register(Method("echo-test", "again"))
        target = tiny_model("llama")
        dec = SpecDecoder(target, draft=perturbed(target, 0.6))
        prompt = prompt_of(20, seed=9)
        out = dec.generate_ids([prompt], "echo-test", 12, SamplingConfig(), length="3")
        assert out.tokens[0] == hf_generate(target, prompt, 12, SamplingConfig())
        res = run_bench(dec, ["echo-test:length=1", "sd:draft_length=2", "sd"], [Prompt("p", "c", prompt)], 8,
                        progress=False)
        assert set(res["summary"]) == {"hf", "echo-test:length=1", "sd:draft_length=2", "sd"}
        assert all(s["identical_rate"] == 1.0 for s in res["summary"].values())
        with pytest.raises(ValueError, match="unknown options for 'echo-test'"):  # checked before anything runs
            run_bench(dec, ["echo-test:k=1"], [Prompt("p", "c", prompt)], 8, progress=False)
    finally:
        methods.REGISTRY.pop("echo-test")


def test_cli_reports_bad_options_clearly(capsys):
    rc = main(["generate", "--model", "nonexistent-model-folder", "--method", "medusa", "--prompt", "x"])
    assert rc == 2
    with pytest.raises(SystemExit):
        main(["generate", "--method", "pld", "--strategy", "magic", "--prompt", "x"])


def test_builders_use_only_the_build_context():
    """A builder sees the decoder through methods.BuildContext alone: every method builds on a view that
    exposes nothing else, and the decoder satisfies the protocol."""
    members = {n for n in vars(methods.BuildContext) if not n.startswith("_")} | set(methods.BuildContext.__annotations__)

    class OnlyContext:
        def __init__(self, dec):
            self._dec = dec

        def __getattr__(self, name):
            if name not in members:
                raise AssertionError(f"a builder read dec.{name}, which BuildContext does not declare")
            return getattr(self._dec, name)

    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    assert isinstance(dec, methods.BuildContext)
    view = OnlyContext(dec)
    for name in methods.names():
        spec = methods.get(name)
        if spec.build is not None:
            assert isinstance(spec.build(view, spec.parse({}), SamplingConfig()), methods.Built), name
    with pytest.raises(AssertionError, match="does not declare"):
        view.generate_ids


def test_build_returns_one_type():
    """Every builder returns a methods.Built: a drafter with its policy, or a loop of its own, never both."""
    from specdec.drafters import PromptLookupDrafter
    from specdec.policies import StaticLength

    drafter, policy = PromptLookupDrafter(3), StaticLength(3)
    assert methods.Built(drafter, policy).margin(100) == drafter.max_tree_size(3)

    class Loop:
        needs_hidden, margin = False, 7

    assert methods.Built(loop=Loop()).margin(100) == 7
    for bad in (dict(), dict(drafter=drafter, loop=Loop()), dict(loop=Loop(), policy=policy)):
        with pytest.raises(TypeError, match="exactly one|its length policy"):
            methods.Built(**bad)
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    for name in methods.names():
        spec = methods.get(name)
        if spec.build is not None:
            assert isinstance(spec.build(dec, spec.parse({}), SamplingConfig()), methods.Built), name
