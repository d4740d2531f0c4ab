"""`build_report` on a really trained tiny run (plus hand-made eval results), on partial and
broken run dirs, and in headless Chromium: every figure decodes, nothing logs to the console,
and an injected script is neither rendered as markup nor run."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import types
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from moetune.errors import MoetuneError
from moetune.io import adapter_digest
from moetune.report import ReportError, build_report
from moetune.report.plots import pick_layers
from moetune.train import train
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

EVIL = "<script>alert(1)</script>"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = shutil.which("chromium")

LADDER = {
    "model": "tiny-base",
    "adapter": "adapter",
    "seconds": 42.5,
    "time": 1764460800.0,
    "rungs": [
        {
            "name": "reverse-words",
            "kind": "exact_match",
            "role": "target",
            "unit": "accuracy",
            "n": 200,
            "base": {"score": 0.12, "stderr": 0.023},
            "candidate": {"score": 0.64, "stderr": 0.034},
            "delta": 0.52,
            "se_delta": 0.035,
            "extra": {},
        },
        {
            "name": "copy-skill",
            "kind": "exact_match",
            "role": "protected",
            "unit": "accuracy",
            "n": 200,
            "base": {"score": 0.81, "stderr": 0.028},
            "candidate": {"score": 0.79, "stderr": 0.029},
            "delta": -0.02,
            "se_delta": 0.02,
            "extra": {},
        },
        {
            "name": "heldout-loss",
            "kind": "loss",
            "role": "protected",
            "unit": "neg_nll",
            "n": 150,
            "base": {"score": -2.41, "stderr": 0.05},
            "candidate": {"score": -2.45, "stderr": 0.05},
            "delta": -0.04,
            "se_delta": 0.015,
            "extra": {"tokens": 4100},
        },
    ],
}


def _gate_rung(name: str, role: str, delta: float, se: float, threshold: float) -> dict:
    z = 2.39
    return {
        "name": name,
        "role": role,
        "status": "pass",
        "delta": delta,
        "se_delta": se,
        "z": z,
        "lower": delta - z * se,
        "upper": delta + z * se,
        "threshold": threshold,
        "n": 200,
        "n_needed": None,
        "base_score": 0.5,
        "candidate_score": 0.5 + delta,
        "reason": f"{name}: lower bound clears {threshold}",
    }


VERDICT = {
    "verdict": "GO",
    "alpha": 0.05,
    "reason": "the target improved and no protected rung regressed",
    "hash": "3f2a9c1e5b7d4a60",
    "rungs": [
        _gate_rung("reverse-words", "target", 0.52, 0.035, 0.05),
        _gate_rung("copy-skill", "protected", -0.02, 0.02, -0.1),
        _gate_rung("heldout-loss", "protected", -0.04, 0.015, -0.1),
    ],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run trained for real; its data path carries markup, as a file name may."""
    root = tmp_path_factory.mktemp("report")
    model = save_tiny_model(root / "model")
    (root / "<script>alert(1)<").mkdir()
    data = write_jsonl(root / "<script>alert(1)<" / "script>.jsonl", reverse_rows(16))
    cfg = run_config(model, data, root / "run-report", max_steps=4, routing_every=1)
    with one_thread():
        train(cfg, progress=False)
    run = root / "run-report"
    assert EVIL in (run / "config.yaml").read_text()  # the data path really is in the config
    return run


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory):
    """A copy of the run with eval results, a promotion marker, and its report."""
    run = tmp_path_factory.mktemp("evaluated") / "run-evaluated"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("checkpoints"))
    (run / "eval").mkdir()
    (run / "eval" / "ladder.json").write_text(json.dumps(LADDER))
    (run / "eval" / "verdict.json").write_text(json.dumps(VERDICT))
    digest = adapter_digest(run / "adapter")  # what `gate --promote` records
    marker = {"verdict_hash": VERDICT["hash"], "adapter_sha256": digest}
    (run / "adapter" / "PROMOTED").write_text(json.dumps(marker))
    report = build_report(run)
    return types.SimpleNamespace(run=run, report=report, html=report.read_text())


def _pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in DATA_URI.findall(html)]


def test_report_holds_every_section_of_an_evaluated_run(evaluated):
    html = evaluated.html
    assert evaluated.report == evaluated.run / "report.html"
    assert "<h1>run-evaluated " in html
    assert '<span class="badge go">GO</span>' in html
    assert "promoted (verdict 3f2a9c1e5b7d" in html
    for rung in LADDER["rungs"]:
        assert html.count(f"<td>{rung['name']}</td>") == 2  # ladder table and gate table
    assert "0.64 ± 0.034" in html and "+0.52" in html  # candidate score, delta
    assert "not available" not in html
    summary = json.loads((evaluated.run / "summary.json").read_text())
    measured = summary["memory"]["measured_peak_bytes"]
    assert f"{measured:,}" in html  # measured peak next to the plan
    assert f"{summary['memory']['planned_peak_bytes']:,}" in html


def test_figures_are_embedded_pngs_and_nothing_loads_from_outside(evaluated):
    html = evaluated.html
    pngs = _pngs(html)
    # memory, loss, expert load, ladder – and no other image source
    assert len(pngs) == 4 == html.count("<img ")
    for png in pngs:
        assert png.startswith(PNG_SIGNATURE)
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert 200 < width < 1400 and 50 < height < 1000  # IHDR: modest, fixed-dpi figures
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html and "url(" not in html and "@import" not in html
    csp = unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', html)[1])
    assert csp.startswith("default-src 'none'; img-src data:;")  # the browser loads nothing else
    assert len(html) < 400_000


def test_config_strings_are_escaped(evaluated):
    html = evaluated.html
    assert EVIL not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.jsonl" in html  # shown, as text
    assert html.count("<script") == 1  # the report's own render check only


def test_no_pyplot_figures_are_left_open(evaluated):
    import matplotlib.pyplot as plt

    build_report(evaluated.run, out=evaluated.run / "again.html")
    assert plt.get_fignums() == []


def test_an_adapter_swapped_after_promotion_reads_not_promoted(evaluated, tmp_path):
    run = tmp_path / "swapped"
    shutil.copytree(evaluated.run, run)
    weights = run / "adapter" / "adapter_model.safetensors"
    swapped = bytearray(weights.read_bytes())
    swapped[-1] ^= 0xFF  # same size and name, other bytes
    weights.write_bytes(bytes(swapped))
    html = build_report(run, out=tmp_path / "swapped.html").read_text()
    assert "NOT PROMOTED" in html and "changed after it was promoted" in html
    assert "promoted (verdict" not in html


def test_trained_weights_are_as_readable_as_the_umask_allows(trained):
    from moetune.io import umask

    want = 0o666 & ~umask()  # safetensors alone would leave them 0600
    for path in (trained / "adapter").iterdir():
        assert path.stat().st_mode & 0o777 == want, path
    for path in (trained / "checkpoints").rglob("*.safetensors"):
        assert path.stat().st_mode & 0o777 == want, path


def test_run_without_eval_says_so_and_still_plots_the_loss(trained, tmp_path):
    report = build_report(trained, out=tmp_path / "report.html")
    html = report.read_text()
    assert not (trained / "report.html").exists()  # out= is honoured
    assert f"not available (no ladder.json in {trained / 'eval'}" in html
    assert "run `moetune gate` first" in html
    assert '<span class="badge none">not gated</span>' in html
    assert "not promoted" in html
    assert re.search(r'alt="loss curve" src="data:image/png;base64,', html)
    assert "4 logged steps" in html
    assert len(_pngs(html)) == 3  # memory, loss, expert load


def test_partial_run_dir_renders_what_it_has(trained, tmp_path):
    """Only config.yaml, a torn metrics line, a corrupt summary and many MoE layers."""
    run = tmp_path / "partial"
    run.mkdir()
    shutil.copy(trained / "config.yaml", run / "config.yaml")
    (run / "summary.json").write_text("{not json")
    rows = [{"step": 1, "loss": 2.0, "lr": 0.01}, {"step": 2, "loss": 1.5, "lr": 0.01}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    layers = [
        {"layer": i, "tokens_per_expert": [i + 1, 2, 3, 4], "collapsed": i == 5} for i in range(24)
    ]
    rows = [{"step": s, "layers": layers} for s in (2, 4, 6)]
    (run / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = build_report(run).read_text()
    assert "2 logged steps" in html  # the torn last line is skipped
    assert "24 MoE layers, showing 8 evenly spaced: 0, 3, 7, 10, 13, 16, 20, 23" in html
    assert "routing collapse in layer 5" in html
    assert "the base&#39;s routing was not measured" in html  # summary.json unreadable
    assert 'Memory</h2>\n<p class="na">not available (no memory plan' in html
    assert "unfinished (no summary.json yet)" not in html  # a summary exists, though corrupt
    assert len(_pngs(html)) == 2  # loss and expert load


def test_a_collapse_the_base_already_had_is_not_blamed_on_the_fine_tune(trained, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained / "config.yaml", run / "config.yaml")
    base = [{"layer": 0, "top1_share": 0.55}, {"layer": 1, "top1_share": 0.2}]
    routing = {"base": base, "drifted_layers": [1]}
    (run / "summary.json").write_text(json.dumps({"routing": routing}))
    layers = [{"layer": i, "tokens_per_expert": [9, 1, 1, 1], "collapsed": True} for i in (0, 1)]
    (run / "routing.jsonl").write_text(json.dumps({"step": 3, "layers": layers}) + "\n")
    text = unescape(build_report(run).read_text())
    assert (
        "layer 0 (one expert the first choice of > 50 % of tokens) at steps 3 – as the base "
        "already routed (base 55%): not the fine-tune's doing" in text
    )
    assert (
        "layer 1 (one expert the first choice of > 50 % of tokens) at steps 3 – drifted "
        "from the base (base 20%)" in text
    )


def test_grpo_routing_shift_is_plotted_with_the_layers_over_the_warning(trained, tmp_path):
    run = tmp_path / "grpo"
    run.mkdir()
    shutil.copy(trained / "config.yaml", run / "config.yaml")
    shares = {1: (0.01, 0.02), 2: (0.03, 0.3), 3: (0.01, 0.04)}  # layer 2 crosses 0.2
    rows = [
        {"step": s, "mean_shift": sum(v[j] for v in shares.values()) / 3,
         "layers": [{"layer": k, "tokens": 50, "shift": v[j]} for k, v in shares.items()]}
        for j, s in enumerate((1, 2))
    ]  # fmt: skip
    (run / "routing_shift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = build_report(run).read_text()
    section = html[html.index("<h2>Routing shift</h2>") : html.index("<h2>Eval ladder</h2>")]
    assert "2 steps; mean shift 6.83%, worst step 12.00%; 3 MoE layers" in section
    assert "above the warning line in layer 2</p>" in section and "layer 3</p>" not in section
    assert "train.grpo.shift_warn (0.2)" in section
    assert len(_pngs(section)) == 1
    # per layer: the token-weighted set share, the first-choice share (absent: –), the worst
    assert '<tr><td>2</td><td class="n">100</td><td class="n">16.50%</td>' in section
    assert '<td class="n">–</td><td class="n">30.00%</td></tr>' in section
    rows[1]["layers"][1]["top1_shift"] = 0.1  # a record with first choices: 0.1 × 50 / 100
    (run / "routing_shift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = build_report(run).read_text()
    assert '<td class="n">16.50%</td><td class="n">5.00%</td>' in section
    plain = build_report(trained, out=tmp_path / "sft.html").read_text()  # sft: no rollouts
    assert "the method samples no rollouts (only grpo does)" in plain


def test_pick_layers_caps_and_spreads_evenly():
    assert pick_layers(list(range(5))) == [0, 1, 2, 3, 4]
    picked = pick_layers(list(range(48)))
    assert len(picked) == 8 and picked[0] == 0 and picked[-1] == 47
    gaps = {b - a for a, b in itertools.pairwise(picked)}
    assert max(gaps) - min(gaps) <= 1


@pytest.mark.parametrize("make", ["missing", "no_config", "bad_yaml"])
def test_bad_run_dir_raises_report_error(tmp_path, make):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
    if make == "bad_yaml":
        (run / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ReportError) as info:
        build_report(run)
    assert isinstance(info.value, MoetuneError) and info.value.fix
    assert str(run) in info.value.cause
    assert not (run / "report.html").exists()


# ---------------------------------------------------------------- headless Chromium

FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=3000",
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)


def _chromium(tmp: Path, page: Path, *args: str) -> tuple[str, str]:
    """(stdout, stderr) of one headless Chromium run on `page`, with a fresh profile."""
    assert CHROMIUM is not None
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def _console(log: str) -> list[str]:
    """Chromium's lines for page console messages ("...:INFO:CONSOLE:12] "text", source: …")."""
    return [line for line in log.splitlines() if "CONSOLE" in line]


@needs_chromium
def test_report_renders_in_headless_chromium(evaluated, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report-screenshot.png"
    shot.unlink(missing_ok=True)
    _chromium(tmp_path, evaluated.report, f"--screenshot={shot}", "--window-size=1280,2400")
    dom, log = _chromium(tmp_path, evaluated.report, "--dump-dom")
    assert 'data-rendered="ok"' in dom  # the render check ran: every figure decoded
    assert _console(log) == []  # no console output: no broken figure, no CSP violation
    png = shot.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000


@needs_chromium
def test_browser_check_catches_a_broken_figure_and_blocks_injected_script(evaluated, tmp_path):
    """The checks above can fail: a corrupt figure is reported, and a script that got past
    escaping would still not run (the CSP allows only the report's own script)."""
    html = evaluated.html.replace(
        DATA_URI.findall(evaluated.html)[1], "iVBORw0KGgoAAAANSUhEUgAA", 1
    )
    html = html.replace(
        "</body>", '<script>document.body.dataset.injected = "ran";</script></body>'
    )
    page = tmp_path / "broken.html"
    page.write_text(html)
    dom, log = _chromium(tmp_path, page, "--dump-dom")
    assert 'data-rendered="broken:1"' in dom
    assert "data-injected" not in dom
    assert any("figure did not decode: loss curve" in line for line in _console(log))


def test_cli_report_writes_the_file_and_fails_cleanly(trained, tmp_path):
    from typer.testing import CliRunner

    from moetune.cli import app

    out = tmp_path / "r.html"
    got = CliRunner().invoke(app, ["report", str(trained), "--out", str(out), "--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["report"] == str(out) and "<html" in out.read_text()
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert bad.exit_code == 2 and "fix:" in bad.output


def test_report_out_never_overwrites_a_file_it_did_not_write(trained, tmp_path):
    from typer.testing import CliRunner

    from moetune.cli import app

    mine = tmp_path / "notes.html"
    mine.write_text("<!DOCTYPE html><title>my notes</title>")
    for out in (mine,):  # a folder: test_report_out_a_folder_a_device_or_unwritable_is_one_line
        got = CliRunner().invoke(app, ["report", str(trained), "--out", str(out)])
        assert got.exit_code == 2 and "Traceback" not in got.output, got.output
        assert "is not a report moetune wrote" in " ".join(got.output.split())
    assert mine.read_text() == "<!DOCTYPE html><title>my notes</title>"
    ours = tmp_path / "ours.html"
    for _ in range(2):  # its own report it rewrites
        got = CliRunner().invoke(app, ["report", str(trained), "--out", str(ours)])
        assert got.exit_code == 0, got.output


def test_report_out_a_folder_a_device_or_unwritable_is_one_line(trained, tmp_path):
    """Issue 36 item 8: --out a directory was exit 3 (IsADirectoryError on the rename); a
    device was worse: as root the rename replaced /dev/null-like files with the report."""
    (tmp_path / "a-file").write_text("x")
    cases = {
        tmp_path: "is a directory, not a file",
        Path("/dev/null"): "is not a regular file",
        tmp_path / "a-file" / "report.html": "cannot be created: ",
    }
    for out, why in cases.items():
        with pytest.raises(ReportError, match=f"report --out .* {why}") as info:
            build_report(trained, out=out)
        assert "pass --out a file path in a writable folder" in info.value.fix
    assert Path("/dev/null").is_char_device() and (tmp_path / "a-file").read_text() == "x"
    assert not list(tmp_path.glob(".*.tmp"))


def test_memory_ratio_compares_like_with_like(tmp_path: Path) -> None:
    """A CPU run's peak RSS holds the whole process: the ratio is shown against a plan that
    counts the process baseline (0.90 here), never against tensors alone (it read 5x)."""
    from moetune.report.html import Inputs, memory_section

    mib = 2**20
    tensors = {"frozen_weights": 100 * mib}
    summary = {"memory": {"measured_peak_bytes": 630 * mib, "measured": "process_peak_rss"}}

    def section(peak: int, components: dict[str, int]) -> dict[str, Any]:
        plan = {"kind": "memory", "label": "one device", "peak_bytes": peak}
        files = {"summary.json": summary, "preflight.json": {"run_plan": {**plan,
                 "components": components}}}  # fmt: skip
        return memory_section(Inputs(tmp_path, {}, files))

    process = section(700 * mib, {**tensors, "process_baseline": 600 * mib})
    assert process["ratio"] == pytest.approx(0.9)
    assert "as the plan counts it" in process["rows"][-1][2]
    old = section(100 * mib, tensors)  # a run dir from before: RSS against tensors
    assert old["ratio"] is None and "not comparable" in old["rows"][-1][2]


def test_a_no_go_shows_the_failing_rungs_items_and_an_unpromoted_export(evaluated, tmp_path):
    run = tmp_path / "no-go"
    shutil.copytree(evaluated.run, run)
    (run / "adapter" / "PROMOTED").unlink()
    example = {"i": 7, "prompt": "rev:abc>", "expected": "cba", "base_output": "cba",
               "candidate_output": "<b>zzz</b>"}  # fmt: skip
    failing = {**VERDICT["rungs"][1], "status": "fail", "examples": [example]}
    verdict = {**VERDICT, "verdict": "NO-GO", "rungs": [VERDICT["rungs"][0], failing]}
    (run / "eval" / "verdict.json").write_text(json.dumps(verdict))
    note = "exported with --unpromoted: the adapter was evaluated (NO-GO) and never promoted"
    check = {"passed": True, "consumer": "transformers", "items": 4}
    exports = {"merged": {"out": "merged/", "files": [], "check": check, "unpromoted": note}}
    (run / "exports.json").write_text(json.dumps(exports))
    html = build_report(run, out=tmp_path / "no-go.html").read_text()
    assert "Failing rungs: the worst items" in html
    row = '<td>copy-skill</td><td class="n">7</td><td class="w">rev:abc&gt;</td>'
    assert row in html and "&lt;b&gt;zzz&lt;/b&gt;" in html  # the outputs, escaped
    assert "served == trained · NOT PROMOTED" in html and note in html
    assert "not promoted" in html
