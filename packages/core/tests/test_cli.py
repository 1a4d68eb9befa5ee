"""The `zero` command: estimate, env, commands from other distributions and the dispatch, through `main([...])`,
and the console script once. `zero bench` itself is tested with the bench (tests/test_bench_launch.py)."""

import ast
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_core
from zero_core import LossScale, Precision, ZeroConfig, estimate
from zero_core.cli import _cli
from zero_core.cli._cli import main
from zero_core.cli._cli_common import human_bytes
from zero_core.cli._cli_estimate import parse_count

CORE_SRC = Path(zero_core.__file__).parent
REPO = Path(__file__).resolve().parents[3]
BUILT_IN = {("shard strategy", "chunk"), ("shard strategy", "tensor"), ("comm backend", "torch"),
            ("comm backend", "bucketed"), ("placement policy", "device"), ("placement policy", "host"),
            ("placement policy", "gemini"), ("placement policy", "static")}


def run(capsys, *argv: str, code: int = 0) -> str:
    assert main(list(argv)) == code, capsys.readouterr()
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return out if code == 0 else err


@pytest.mark.parametrize(("text", "count"), [("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("350M", 350_000_000),
                                             ("1.3b", 1_300_000_000), ("125k", 125_000), ("7_000_000_000", 7_000_000_000),
                                             ("1.5T", 1_500_000_000_000), ("123", 123)])
def test_parameter_counts(text, count):
    assert parse_count(text) == count


def test_estimate_by_world_size_prints_the_estimators_figures(capsys):
    out = run(capsys, "estimate", "--params", "7e9", "--world-size", "64", "--stage", "3")
    e = estimate(7_000_000_000, world_size=64, config=ZeroConfig(stage=3))
    ddp = estimate(7_000_000_000, mesh_shape=(64, 1), config=ZeroConfig(stage=1))
    assert "7,000,000,000 parameters on 64 ranks" in out and "stage 3" in out
    for kind, n in e.per_rank[0].items():
        assert f"{kind.replace('_', ' ')} " in out and human_bytes(n) in out
    for kind, n in e.bytes_sent.items():
        assert kind in out and human_bytes(n) in out
    assert human_bytes(e.formula["model_state_bytes"]) in out and human_bytes(e.formula["bytes_sent"]) in out
    # DDP: a full fp32 replica with Adam (16 bytes a parameter) and one fp32 all-reduce of 4-byte gradients
    assert ddp.max_model_state_bytes == 16 * 7_000_000_000 and ddp.total_bytes_sent == round(2 * 63 / 64 * 4 * 7e9)
    assert human_bytes(ddp.max_model_state_bytes) in out and human_bytes(ddp.total_bytes_sent) in out
    assert "all_reduce" not in out  # no replicas, no all-reduce


def test_estimate_by_mesh_shows_both_groups(capsys):
    out = run(capsys, "estimate", "--params", "350M", "--mesh", "2x4", "--precision", "fp16", "--reduce", "bf16",
              "--gpus-per-node", "4")
    config = ZeroConfig(precision=Precision(compute="fp16", reduce="bf16", loss_scale=LossScale()))
    e = estimate(350_000_000, mesh_shape=(2, 4), config=config)
    assert "8 ranks as a 2x4 mesh" in out and "compute fp16, reduce bf16" in out
    assert "replicate (2 ranks)" in out and "shard (4 ranks)" in out
    assert human_bytes(e.bytes_sent["all_reduce"]) in out
    assert human_bytes(e.formula["bytes_sent_replicate"]) in out and human_bytes(e.formula["bytes_sent_shard"]) in out
    assert f"crossing nodes of 4 GPUs (ring model): {human_bytes(e.inter_node_bytes(4))}" in out


def test_estimate_json_is_the_estimate(capsys):
    data = json.loads(run(capsys, "estimate", "--params", "1.3b", "--mesh", "2x2", "--stage", "2", "--json",
                          "--optimizer-bytes-per-element", "4"))
    e = estimate(1_300_000_000, mesh_shape=(2, 2), config=ZeroConfig(stage=2), optimizer_bytes_per_element=4)
    expected = json.loads(json.dumps(dataclasses.asdict(e)))  # tuples as JSON lists
    assert {k: data[k] for k in expected} == expected
    assert data["max_model_state_bytes"] == e.max_model_state_bytes and data["total_bytes_sent"] == e.total_bytes_sent
    assert data["ddp"]["model_state_bytes"] == (4 + 4 + 4) * 1_300_000_000


def test_estimate_places_states_by_tier(capsys):
    out = run(capsys, "estimate", "--params", "1e9", "--world-size", "8", "--placement", "static",
              "--placement-option", "offload_optim_frac=1")
    tiers = estimate(10**9, world_size=8, config=ZeroConfig(placement="static",
                                                            placement_options={"offload_optim_frac": 1})).tiers[0]
    assert tiers["host"] > 0 and tiers["device"] > 0
    for tier in ("device", "host"):
        assert re.search(rf"on {tier}\s+{re.escape(human_bytes(tiers[tier]))}\n", out), tier
    gemini = run(capsys, "estimate", "--params", "1e9", "--world-size", "8", "--placement", "gemini")
    assert "placement 'gemini' decides at run time" in gemini


def test_estimate_reads_a_config_file_and_flags_override_it(capsys, tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 2, "precision": {"compute": "bf16"}}))
    out = run(capsys, "estimate", "--params", "1e9", "--world-size", "8", "--config", str(path))
    assert "stage 2" in out and "compute bf16" in out
    out = run(capsys, "estimate", "--params", "1e9", "--world-size", "8", "--config", str(path), "--stage", "1")
    e = estimate(10**9, world_size=8, config=ZeroConfig.from_file(path).replace(stage=1))
    assert "stage 1" in out and "compute bf16" in out and human_bytes(e.max_model_state_bytes) in out


def test_estimate_builds_a_hugging_face_config_on_the_meta_device(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    config.save_pretrained(tmp_path)
    out = run(capsys, "estimate", "--model", str(tmp_path), "--world-size", "4")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    e = estimate(model, world_size=4)
    assert f"{e.params:,} parameters" in out and "exact, chunk by chunk" in out
    assert e.calls is not None
    assert f"total {sum(e.calls.values())} {human_bytes(e.total_bytes_sent)}" in " ".join(out.split())
    assert human_bytes(e.max_model_state_bytes) in out
    assert f"padding: {100 * (e.padded_params - e.params) / e.params:.2f}%" in out


def test_estimate_compares_the_strategies_side_by_side(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64).save_pretrained(tmp_path)
    out = run(capsys, "estimate", "--model", str(tmp_path), "--world-size", "4", "--stage", "3", "--compare-strategies")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path),
                                                              dtype=torch.float32)
    table = out[out.index("strategy  padding"):]
    for name in ("chunk", "tensor"):
        e = estimate(model, world_size=4, config=ZeroConfig(stage=3, strategy=name))
        row = f"{name} {100 * (e.padded_params - e.params) / e.params:.2f}% {e.calls['all_gather']} {e.calls['reduce_scatter']}"
        assert row in " ".join(table.split()), (row, table)


@pytest.mark.parametrize(("argv", "code", "fragment"), [
    ([], 2, "the following arguments are required: COMMAND"),
    (["nope"], 2, "invalid choice: 'nope'"),
    (["estimate", "--world-size", "8"], 2, "one of the arguments --params --model is required"),
    (["estimate", "--params", "7x", "--world-size", "8"], 2, "'7x' is not a parameter count; write e.g. 7e9, 7B"),
    (["estimate", "--params", "1.5", "--world-size", "8"], 2, "not a positive whole number"),
    (["estimate", "--params", "0", "--world-size", "8"], 2, "not a positive whole number"),
    (["estimate", "--params", "7B"], 2, "give the ranks: --world-size N"),
    (["estimate", "--params", "7B", "--mesh", "8x"], 2, "not a mesh shape; write RxS"),
    (["estimate", "--params", "7B", "--world-size", "0"], 2, "'0' is not a positive integer"),
    (["estimate", "--params", "7B", "--world-size", "8", "--stage", "4"], 2, "invalid choice: 4"),
    (["estimate", "--params", "7B", "--world-size", "8", "--placement-option", "x"], 2, "is not KEY=VALUE"),
    (["estimate", "--params", "7B", "--world-size", "64", "--mesh", "4x4"], 1, "mesh_shape=(4, 4) spans 16 ranks"),
    (["estimate", "--params", "7B", "--world-size", "8", "--placement", "nope"], 1,
     "no placement policy named 'nope' is registered (available: device,"),
    (["estimate", "--params", "7B", "--world-size", "8", "--strategy", "nope"], 1, "no shard strategy named 'nope'"),
    (["estimate", "--params", "7B", "--world-size", "8", "--placement", "static", "--placement-option",
      "offload_optim_frac=3"], 1, "offload_optim_frac must be a fraction in [0, 1]"),
    (["estimate", "--params", "7B", "--world-size", "8", "--config", "/nowhere/zero.json"], 1, "no such file"),
    (["estimate", "--model", "/nowhere", "--world-size", "8"], 1, "never downloads"),
    (["consolidate", "/nowhere", "/nowhere-out"], 1, "does not exist"),
])
def test_bad_input_says_what_is_wrong(capsys, argv, code, fragment):
    err = run(capsys, *argv, code=code)
    assert fragment in err
    assert err.count("error:") == 1


def test_bad_config_file_names_the_key(capsys, tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"precision": {"compute": "fp64"}}))
    err = run(capsys, "estimate", "--params", "7B", "--world-size", "8", "--config", str(path), code=1)
    assert "precision.compute" in err


def test_env_lists_torch_distributions_and_every_built_in_plugin(capsys):
    out = run(capsys, "env")
    assert re.search(rf"^torch\s+{re.escape(torch.__version__)}\s", out, re.M) and "gloo yes" in out
    for kind, name in BUILT_IN:
        assert re.search(rf"^  {kind}\s+{name}\s", out, re.M), name
    report = json.loads(run(capsys, "env", "--json"))
    registered = {(r["kind"], r["name"]): r for r in report["plugins"]["registered"]}
    assert BUILT_IN <= registered.keys()
    assert registered[("placement policy", "device")]["distribution"] == "zero-core"
    assert registered[("shard strategy", "chunk")]["distribution"] == "zero-strategy-chunk"
    assert all(r["version"] for r in registered.values())
    assert {d["name"] for d in report["distributions"]} >= {"zero-core", "zero-comm", "zero-strategy-chunk"}
    assert report["torch"]["backends"]["gloo"] is True
    assert set(report["packages"]) >= {"transformers", "PyYAML", "rich", "matplotlib"}


def register_command(monkeypatch, tmp_path, entry_points: str, module: str = "") -> None:
    """An installed distribution zero-fake whose entry_points.txt is ``entry_points`` (and module zero_fake_cli)."""
    info = tmp_path / "zero_fake-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zero-fake\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    if module:
        (tmp_path / "zero_fake_cli.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zero_fake_cli", raising=False)


_FAKE = '''
def hello(argv):
    """Say hello to every argument.

    More lines the help leaves out.
    """
    if argv == ["--help"]:
        print("hello's own help")
        raise SystemExit(0)
    print("hello", *argv)
    return len(argv)


def env(argv):
    raise AssertionError("a built-in command is never replaced")
'''


def test_a_distribution_adds_a_command_through_the_zero_cli_group(capsys, monkeypatch, tmp_path):
    # See [Note: commands from other distributions] in zero_core.cli._cli.
    register_command(monkeypatch, tmp_path, "[zero.cli]\nhello = zero_fake_cli:hello\nenv = zero_fake_cli:env\n"
                     "broken = zero_fake_cli_gone:run\n", _FAKE)
    top = run(capsys, "--help")
    assert re.search(r"^    hello\s+say hello to every argument \(from zero-fake\)$", top, re.M), top
    assert re.search(r"^    broken\s+from zero-fake; fails to load: ModuleNotFoundError", top, re.M), top
    assert main(["hello", "--world-size", "x", "estimate"]) == 3  # every argument after the name is the command's
    assert capsys.readouterr().out == "hello --world-size x estimate\n"
    assert run(capsys, "hello", "--help") == "hello's own help\n"
    assert "zero distributions" in run(capsys, "env")  # zero-core's own command, not zero-fake's


def test_a_missing_bench_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(_cli, "_commands", dict)  # as if zero-bench were not installed
    monkeypatch.chdir(tmp_path)  # outside any checkout
    top = run(capsys, "--help")
    assert re.search(r"^    bench\s+run the benchmark against DDP and FSDP2 \(not installed", top, re.M), top
    err = run(capsys, "bench", "--quick", code=1)
    assert "comes with the zero-bench distribution, which is not installed" in err
    assert "pip install --find-links DIST 'zero-bench[plot,rich]'" in err
    monkeypatch.chdir(REPO)  # from a checkout: its editable install
    assert f"pip install -e '{REPO / 'benchmarks'}[plot,rich]'" in run(capsys, "bench", code=1)


def test_help_everywhere(capsys):
    top = run(capsys, "--help")
    for command in ("estimate", "env", "bench", "consolidate"):  # bench: installed or not, with how to install it
        assert f"    {command}" in top
    for command in ("estimate", "env", "consolidate"):
        assert "examples:" in run(capsys, command, "--help")
    assert run(capsys, "--version").strip() == f"zero-core {zero_core.__version__}"


def test_cli_modules_import_torch_only_when_a_command_runs():
    """`zero --help` builds every command's parser: the modules it imports take the standard library only."""
    for path in [CORE_SRC / "_cli.py", *sorted(CORE_SRC.glob("_cli_*.py"))]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name.startswith("zero_core.cli._cli") \
                    or name in ("zero_core", "zero_core.base._version"), f"{path.name} imports {name} at module level"


def test_console_script():
    zero = shutil.which("zero")
    assert zero, "the console script of zero-core is not installed: pip install -e packages/core"
    done = subprocess.run([zero, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "estimate" in done.stdout and "consolidate" in done.stdout, done.stderr
    done = subprocess.run([zero, "env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "zero-core" in done.stdout and "chunk" in done.stdout, done.stderr


_NO_TORCH = """
import sys
from zero_core.cli import _cli
from zero_core.cli._cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("torch imported" if any(m == "torch" or m.startswith("torch.") for m in sys.modules) else "no torch", code)
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["estimate", "--bogus"], ["no-such-command"],
                                  ["consolidate", "--help"]])
def test_help_version_and_argument_errors_do_not_import_torch(argv):
    # See [Note: a lazy package]: judged by sys.modules in a fresh interpreter, not by timing.
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1].startswith("no torch"), done.stdout + done.stderr


def test_the_lazy_package_offers_every_name_it_did():
    for name in zero_core.__all__:
        assert getattr(zero_core, name) is not None, name
        assert name in dir(zero_core)
    for module in ("api", "chunk", "comm", "errors", "hookspecs", "mesh", "placement", "plugin", "strategy"):
        # the submodules (at their homes), as attributes
        assert getattr(zero_core, module).__name__ == zero_core._SUBMODULE_HOMES.get(module, f"zero_core.{module}")
    assert zero_core.ZeroConfig.__module__ == "zero_core.config.api"
    with pytest.raises(AttributeError, match="no attribute 'sharded'"):
        zero_core.sharded  # noqa: B018 - the lookup is the test


def test_install_hints_name_a_command_that_works_from_here(tmp_path):
    from zero_core.base._install import install_command

    checkout = tmp_path / "zero"
    (checkout / "packages" / "offload").mkdir(parents=True)
    (checkout / "packages" / "offload" / "pyproject.toml").write_text("[project]\nname = 'zero-offload'\n")
    (checkout / "examples").mkdir()
    assert install_command("zero-offload", cwd=checkout / "examples") == \
        f"pip install -e '{checkout / 'packages' / 'offload'}'"
    wheels = tmp_path / "elsewhere"
    (wheels / "dist").mkdir(parents=True)
    (wheels / "dist" / "zero_integrations-0.1.0-py3-none-any.whl").write_bytes(b"")
    assert install_command("zero-integrations", extra="[hf]", cwd=wheels) == \
        f"pip install --find-links {wheels / 'dist'} 'zero-integrations[hf]'"
    nowhere = install_command("zero-offload", cwd=tmp_path)
    assert "--find-links DIST 'zero-offload'" in nowhere and "pip install -e 'packages/offload'" in nowhere


def test_a_missing_plugin_names_a_working_install_command(monkeypatch):
    from zero_core.interfaces._plugins import ZeroPlugins

    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "zero-offload")
    monkeypatch.chdir(REPO)
    with pytest.raises(zero_core.PluginNotFoundError, match="provided by zero-offload: pip install -e '.*packages/offload'"):
        ZeroPlugins.load().placement_policies.get("gemini")


def test_consolidate_finds_the_zero_folder_of_an_hf_trainer_checkpoint(tmp_path, capsys):
    from zero_core.checkpoint._checkpoint import read_metadata

    trainer = tmp_path / "checkpoint-10"
    (trainer / "zero").mkdir(parents=True)
    (trainer / "zero" / "zero_checkpoint.json").write_text("{}")
    with pytest.raises(zero_core.CheckpointError, match="but .*checkpoint-10/zero inside it is"):
        read_metadata(trainer)
    capsys.readouterr()
    assert main(["consolidate", str(trainer), str(tmp_path / "out")]) == 1  # the stand-in metadata is not a real one
    out, err = capsys.readouterr()
    assert f"consolidating {trainer / 'zero'}" in out, out
    assert "zero_checkpoint.json is not the metadata of a zero sharded checkpoint" in err, err
