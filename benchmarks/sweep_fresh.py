"""The third pass's cases of benchmarks/cli_sweep.py (issue 36): each item's cases (a mixed
source dir, streaming, a huge row, preview vs train; lane.env values of any type, a swapped
promoted adapter, refusals before the ranks; item 8's plainly bad inputs), then fresh ones –
what a new user types next: models whose config.json is wrong in a plausible way, runs
pointed at the wrong things, flags of commands the earlier blocks did not reach, data that
is legal but unusual. Each is a `Case` of sweep_cases.py; {dir} is the case's scratch dir."""

from __future__ import annotations

import json

from sweep_cases import DEMO_BASE, RUN, SECRETS, Case

CONFIG = json.loads((DEMO_BASE / "config.json").read_text())
ROW = '{"prompt": "a", "completion": "b"}\n'
TRAIN = "train: {max_steps: 1, batch_size: 1, seq_len: 16, device: cpu}\n"


def _model(**over: object) -> dict[str, str | bytes]:
    """A model dir `m/` whose config.json is the demo base's with `over` (None drops a key)."""
    cfg = {k: v for k, v in {**CONFIG, **over}.items() if v is not None}
    return {"m/config.json": json.dumps(cfg)}


def _model_cases() -> list[Case]:
    bad = {
        "topk-above-experts": _model(num_experts_per_tok=9),
        "zero-experts": _model(num_local_experts=0),
        "no-model-type": _model(model_type=None),
        "unknown-type": _model(model_type="frobnicate_moe"),
        "negative-layers": _model(num_hidden_layers=-2),
        "string-hidden": _model(hidden_size="128"),
        "config-not-json": {"m/config.json": "{model_type: qwen3_moe"},
    }
    cases = []
    for name, files in bad.items():
        for cmd in ("inspect", "plan"):
            target = "{dir}/m" if cmd == "inspect" else "{dir}/run.yaml"
            run = {"run.yaml": "model: {id: {dir}/m}\n"} if cmd == "plan" else {}
            cases.append(Case(f"fresh/model/{cmd}/{name}", [cmd, target, "--json"], files | run))
    # legal: head_dim (hidden // heads) times the heads need not equal hidden_size
    files = _model(num_attention_heads=3) | {"run.yaml": "model: {id: {dir}/m}\n"}
    cases.append(Case("fresh/model/plan/heads-not-dividing", ["plan", "{dir}/run.yaml", "--json"],
                      files, "good"))  # fmt: skip
    dense = {k: v for k, v in CONFIG.items() if "expert" not in k}
    dense |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    files = {"m/config.json": json.dumps(dense), "run.yaml": "model: {id: {dir}/m}\n"}
    cases.append(Case("fresh/model/plan/dense", ["plan", "{dir}/run.yaml", "--json"], files))
    return cases


def _train_cases() -> list[Case]:
    data = "data: {train_file: {dir}/t.jsonl}\n"
    base = {"t.jsonl": ROW * 4}
    runs = {
        "no-weights": ("model: {id: {dir}/m}\n" + data + TRAIN, _model()),
        "hub-id-offline": ("model: {id: nobody/NoSuchMoE-A1B}\n" + data + TRAIN, {}),
        "out-is-file": (RUN + data + TRAIN + "output: {dir: {dir}/f}\n", {"f": "mine"}),
        "resume-nothing": (RUN + data + TRAIN + "output: {dir: {dir}/run}\n", {}),
        "eval-file-missing": (RUN + data.replace("}", ", eval_file: {dir}/nope.jsonl}") + TRAIN,
                              {}),
        "seq-len-1": (RUN + data + TRAIN.replace("seq_len: 16", "seq_len: 1"), {}),
        "lr-negative": (RUN + data + TRAIN.replace("device: cpu", "device: cpu, "
                                                  "learning_rate: -1"), {}),
        "device-tpu": (RUN + data + TRAIN.replace("device: cpu", "device: tpu"), {}),
    }  # fmt: skip
    cases = []
    for name, (yaml, files) in runs.items():
        args = ["train", "{dir}/run.yaml", "--json"]
        # --resume with nothing to resume starts the run (a pod that died before the first
        # write is relaunched with the same command)
        args += ["--resume"] if name == "resume-nothing" else []
        expect = "good" if name == "resume-nothing" else "bad"
        cases.append(Case(f"fresh/train/{name}", args, {"run.yaml": yaml} | base | files, expect))
    many = Case("fresh/train/nproc-too-many", ["train", "{dir}/run.yaml", "--nproc", "512"],
                {"run.yaml": RUN + data + TRAIN} | base)  # fmt: skip
    return [*cases, many]


def _data_cases() -> list[Case]:
    src = "data: {sources: [SRC]}\n"
    rows = {
        "bom-jsonl": ("\ufeff" + ROW * 3, "good"),
        "crlf-jsonl": (ROW.replace("\n", "\r\n") * 3, "good"),
        "messages-not-list": ('{"messages": "hi"}\n', "bad"),
        "messages-bad-role": ('{"messages": [{"role": "robot", "content": "x"}]}\n', "bad"),
        "prompt-null": ('{"prompt": null, "completion": "b"}\n', "bad"),
        "only-blank-lines": ("\n\n\n", "bad"),
    }
    cases = [
        Case(f"fresh/data/{name}", ["data", "{dir}/run.yaml", "--json"],
             {"run.yaml": RUN + "data: {train_file: {dir}/t.jsonl}\n", "t.jsonl": text}, expect)
        for name, (text, expect) in rows.items()
    ]  # fmt: skip
    sources = {
        "weight-negative": "{path: {dir}/t.jsonl, weight: -1}",
        "weight-zero": "{path: {dir}/t.jsonl, weight: 0}",
        "no-path": "{weight: 1}",
        "hub-offline": "{path: nobody/no-such-dataset}",
        "template-missing": "{path: {dir}/t.jsonl, chat_template: {dir}/nope.jinja}",
        "split-bogus": "{path: {dir}/t.jsonl, split: nonsense}",
    }
    for name, source in sources.items():
        yaml = RUN + src.replace("SRC", source)
        files = {"run.yaml": yaml, "t.jsonl": ROW * 3}
        cases.append(Case(f"fresh/data/source-{name}", ["data", "{dir}/run.yaml", "--json"], files))
    cases.append(Case("fresh/data/sources-empty", ["data", "{dir}/run.yaml", "--json"],
                      {"run.yaml": RUN + "data: {sources: []}\n"}))  # fmt: skip
    return cases


def _command_cases() -> list[Case]:
    run = {"run.yaml": RUN}
    argv = {
        "plan/card-bogus": ["plan", "{dir}/run.yaml", "--card", "tpu-v9"],
        "plan/offload-bogus": ["plan", "{dir}/run.yaml", "--offload", "cloud"],
        "plan/strategy-bogus": ["plan", "{dir}/run.yaml", "--gpus", "2", "--strategy", "x"],
        "export/format-bogus": ["export", "{dir}", "--format", "onnx", "--out", "{dir}/o"],
        "export/adapter-config-garbage": ["export", "{dir}/a", "--format", "merged",
                                          "--out", "{dir}/o", "--json"],
        "ledger/path-is-dir": ["ledger", "show", "--path", "{dir}", "--json"],
        "serve-plan/no-config": ["serve-plan", "{dir}", "--json"],
        "launch/nnodes-zero": ["launch", "{dir}/run.yaml", "--nnodes", "0", "--dry-run"],
        "launch/provider-ssh-no-host": ["launch", "{dir}/run.yaml", "--set",
                                        "lane.provider=ssh", "--dry-run"],
        "gate/rungs-not-list": ["gate", "{dir}/r.json", "--json"],
        "gate/alpha-one": ["gate", "{dir}/r.json", "--alpha", "1", "--json"],
        "eval/no-adapter": ["eval", "{dir}/run.yaml", "--json"],
        "report/out-dev-full": ["report", "{dir}", "--out", "/dev/full/x.html"],
        "pods/list-bad-provider": ["pods", "list", "--provider", "nowhere", "--json"],
        "workflow/unknown-kind": ["workflow", "gitlab", "{dir}/run.yaml"],
        "bench/unknown": ["bench", "nope"],
    }  # fmt: skip
    extra: dict[str, dict[str, str | bytes]] = {
        "export/adapter-config-garbage": {"a/adapter_config.json": "[1, 2",
                                          "a/adapter_model.safetensors": b"\x00" * 64},
        "gate/rungs-not-list": {"r.json": '{"rungs": {"a": 1}}'},
        "gate/alpha-one": {"r.json": '{"rungs": []}'},
        "eval/no-adapter": {"run.yaml": RUN + "output: {dir: {dir}/never-trained}\n"},
    }  # fmt: skip
    return [Case(f"fresh/{name}", args, run | extra.get(name, {})) for name, args in argv.items()]


def _parquet(rows: list[dict[str, str]]) -> bytes:
    # lazy: heavy to import (pyarrow), and only when the cases are built
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return bytes(sink.getvalue().to_pybytes())


def _png() -> bytes:
    # lazy: heavy to import (PIL), and only when the cases are built
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 20, 20)).save(out, format="PNG")
    return out.getvalue()


def _mixed_dir_stream_and_huge_row_cases() -> list[Case]:
    """A mixed source dir, streaming at default settings, one huge row, and `moetune data`
    refusing what `moetune train` refuses (issue 36 items 1, 2, 3, 7)."""
    pc = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in ("abc", "xyz", "moe")]
    jsonl = "".join(json.dumps(r) + "\n" for r in pc)
    mixed = {"mixed/a.parquet": _parquet(pc), "mixed/b.jsonl": jsonl}
    src = RUN + "data: {sources: [{path: {dir}/mixed}]}\n"
    huge = json.dumps({"prompt": "rev:x>", "completion": "ab " * 1_000_000}) + "\n" + jsonl
    chat = json.dumps({"messages": [{"role": "user", "content": "rev:ab"},
                                    {"role": "assistant", "content": "ba"}]}) + "\n"  # fmt: skip
    image = json.dumps(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "i.png"},
                        {"type": "text", "text": "colour?"},
                    ],
                },
                {"role": "assistant", "content": "red"},
            ]
        }
    )
    one = RUN + "data: {train_file: {dir}/train.jsonl%s}\n"
    stream = RUN + "data: {train_file: {dir}/train.jsonl, streaming: true}\n"
    train = ("train: {max_steps: 2, device: cpu, seq_len: 32, batch_size: 2}\n"
             "output: {dir: {dir}/out, ledger: {dir}/ledger.jsonl}\n")  # fmt: skip
    data = ["data", "{dir}/run.yaml", "--json"]
    return [
        Case("data36/mixed-dir", data, {"run.yaml": src, **mixed}, "good"),
        Case("data36/mixed-dir-txt", data, {"run.yaml": src, **mixed, "mixed/c.txt": "x\n"}),
        Case("data36/streaming-train", ["train", "{dir}/run.yaml", "--json"],
             {"run.yaml": stream + train, "train.jsonl": jsonl}, "good"),
        Case("data36/huge-row", data, {"run.yaml": one % "", "train.jsonl": huge}, "good"),
        Case("data36/huge-row-error", data,
             {"run.yaml": one % ", overlong: error", "train.jsonl": huge}),
        Case("data36/streaming-no-max-steps", data, {"run.yaml": stream, "train.jsonl": jsonl}),
        Case("data36/no-chat-template", data, {"run.yaml": one % "", "train.jsonl": chat}),
        Case("data36/empty-template", data, {"run.yaml": one % ", chat_template: {dir}/t.jinja",
                                             "train.jsonl": jsonl, "t.jinja": ""}),
        Case("data36/template-raises", data, {"run.yaml": one % ", chat_template: {dir}/t.jinja",
             "train.jsonl": chat, "t.jinja": "{{ raise_exception('no') }}"}),
        Case("data36/streamed-images", data, {"run.yaml": stream + "train: {max_steps: 2}\n",
                                              "train.jsonl": image + "\n", "i.png": _png()}),
    ]  # fmt: skip


TYPED_LANE = f"lane: {{env: {{DB_PASS: {SECRETS[3]}, KEYS: [{SECRETS[4]}]}}}}\n"
ROWS = "".join('{"prompt": "abc", "completion": "cba"}\n' for _ in range(8))
TRAIN_RUN = RUN + "data: {train_file: {dir}/t.jsonl}\ntrain: {device: cpu, max_steps: 1}\n"
SWAPPED = {  # an adapter whose PROMOTED marker vouches for other bytes (issue 36 item 6)
    "adapter_config.json": json.dumps({"base_model_name_or_path": str(DEMO_BASE)}),
    "adapter_model.safetensors": b"\x08" + b"\x00" * 7 + b'{"a":1}\n',
    "PROMOTED": json.dumps({"verdict_hash": "0" * 64, "adapter_sha256": "0" * 64}),
}


def _secret_launch_promote_and_overwrite_cases() -> list[Case]:
    """Secrets of any YAML type, launch refusals before any rank starts, a swapped promoted
    adapter, and the files a command must not replace (issue 36 items 4, 5, 6 and 9)."""
    typed, train = {"run.yaml": RUN + TYPED_LANE}, {"run.yaml": TRAIN_RUN, "t.jsonl": ROWS}
    multi = ["train", "{dir}/run.yaml", "--nnodes", "2", "--json"]
    return [
        *[Case(f"secret/typed/{cmd}", [cmd, "{dir}/run.yaml", *more], typed)
          for cmd, more in (("lint", ["--json"]), ("train", []), ("launch", ["--dry-run"]))],
        Case("launch/master-addr-unparsable", [*multi, "--master-addr", "999.1.1.1"], train),
        Case("launch/master-addr-unresolved", [*multi, "--master-addr", "nope.invalid"], train),
        Case("launch/node-1-no-node-0", [*multi, "--node-rank", "1", "--master-addr",
             "127.0.0.1", "--master-port", "9", "--rdzv-timeout", "1"], train),
        Case("launch/offload-nproc-2",
             ["train", "{dir}/run.yaml", "--nproc", "2", "--offload", "cpu", "--json"], train),
        Case("promote/swapped/export",
             ["export", "{dir}", "--format", "vllm", "--out", "{dir}/o", "--json"], SWAPPED),
        Case("misc/export/over-unchecked",
             ["export", "{shared}", "--format", "vllm", "--out", "{dir}", "--json"],
             {"UNCHECKED": "unchecked\n", "export.json": "{}"}),
        Case("misc/report/out-not-ours", ["report", "{shared}", "--out", "{dir}/mine.html"],
             {"mine.html": "<p>my notes</p>"}),
        Case("misc/ledger/kind-typo", ["ledger", "show", "--kind", "trian", "--json"]),
    ]  # fmt: skip


# ------------------------------------- plainly bad input: no exit 3, no partial run dir
# (issue 36 item 8). The case names keep their `item8/` prefix: `cli_sweep.py --only item8`
# and the recorded sweeps in results/cli-sweep.md select them by it.

TRAIN_INTO_RUN = "train: {max_steps: 1, batch_size: 2, seq_len: 32}\noutput: {dir: {dir}/run}\n"
REV_ROWS = "".join(
    json.dumps({"prompt": f"rev:{w}>", "completion": w[::-1]}) + "\n" for w in ("ab", "cd", "ef")
)
CHAT_ROW = json.dumps({"messages": [{"role": "user", "content": "ab"},
                                    {"role": "assistant", "content": "ba"}]}) + "\n"  # fmt: skip


def _damaged_base(how: str) -> dict[str, str | bytes]:
    """The demo base copied under base/, its weights damaged `how`."""
    files: dict[str, str | bytes] = {
        f"base/{p.name}": p.read_text() for p in DEMO_BASE.iterdir() if p.suffix == ".json"
    }
    whole = (DEMO_BASE / "model.safetensors").read_bytes()
    files["base/model.safetensors"] = {
        "cut": whole[: len(whole) // 2],
        "header": whole[:8] + b"\x00" * 64 + whole[72:],
        "shard": whole,
    }[how]
    if how == "shard":  # sharded, the index naming a second shard the folder lacks
        files["base/model-00001-of-00002.safetensors"] = files.pop("base/model.safetensors")
        weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                      "lm_head.weight": "model-00002-of-00002.safetensors"}  # fmt: skip
        index = {"metadata": {"total_size": len(whole)}, "weight_map": weight_map}
        files["base/model.safetensors.index.json"] = json.dumps(index)
    return files


def _small_run(data: str, extra: str = "", model: str = str(DEMO_BASE)) -> str:
    """A one-step run.yaml on `model` that writes to {dir}/run, with `data` and `extra`."""
    return f"model: {{id: {model}}}\ndata: {data}\n{TRAIN_INTO_RUN}{extra}"


def _damaged_base_cases() -> list[Case]:
    """A base cut in half, its header overwritten, or its index naming a missing shard:
    `train` (offload none and disk) and `eval` refuse it."""
    cases = []
    for how in ("cut", "header", "shard"):
        for off in ("none", "disk"):
            run = _small_run("{train_file: {dir}/t.jsonl}", "", "{dir}/base")
            run = run.replace("seq_len: 32}", f"seq_len: 32, offload: {off}}}")
            files = {**_damaged_base(how), "run.yaml": run, "t.jsonl": REV_ROWS}
            cases.append(Case(f"item8/train/base-{how}/offload-{off}",
                              ["train", "{dir}/run.yaml", "--json"], files))  # fmt: skip
        args = ["eval", "{shared}/config.yaml", "--set", "model.id={dir}/base",
                "--set", "eval.results_dir={dir}/ev", "--json"]  # fmt: skip
        cases.append(Case(f"item8/eval/base-{how}", args, _damaged_base(how)))
    return cases


def _bad_template_and_weight_cases() -> list[Case]:
    """Chat templates that do not parse, raise, are binary or call an undefined method, and
    source weights of ±inf, huge and tiny (the mlx stack's too), through `data` and `train`."""
    templates: dict[str, str | bytes] = {
        "syntax": "{% for m in %}",
        "raising": "{{ raise_exception('no') }}",
        "binary": bytes(range(128, 256)),
        "undefined-call": "{{ messages.nope() }}",
    }
    cases = []
    for name, body in templates.items():
        for rows, text in (("chat", CHAT_ROW), ("plain", REV_ROWS)):
            run = _small_run("{train_file: {dir}/t.jsonl, chat_template: {dir}/t.jinja}")
            files = {"run.yaml": run, "t.jsonl": text, "t.jinja": body}
            for cmd in ("data", "train"):
                cases.append(Case(f"item8/{cmd}/jinja-{name}/{rows}",
                                  [cmd, "{dir}/run.yaml", "--json"], files))  # fmt: skip
    for weight in (".inf", "1e300", "0.01", "-.inf", "1e-300"):
        run = _small_run(
            f"{{sources: [{{path: {{dir}}/t.jsonl}}, {{path: {{dir}}/t.jsonl, weight: {weight}}}]}}"
        )
        for cmd in ("data", "train"):
            files = {"run.yaml": run, "t.jsonl": REV_ROWS}
            cases.append(
                Case(f"item8/{cmd}/weight-{weight}", [cmd, "{dir}/run.yaml", "--json"], files)
            )
        mlx = run + "lora: {stack: mlx}\n"
        cases.append(Case(f"item8/train/mlx-weight-{weight}", ["train", "{dir}/run.yaml", "--json"],
                          {"run.yaml": mlx, "t.jsonl": REV_ROWS}))  # fmt: skip
    good = _small_run("{sources: [{path: {dir}/t.jsonl}, {path: {dir}/t.jsonl, weight: 2}]}")
    files = {"run.yaml": good + "lora: {stack: mlx}\n", "t.jsonl": REV_ROWS}
    cases.append(
        Case("item8/train/mlx-sources", ["train", "{dir}/run.yaml", "--json"], files, "good")
    )
    return cases


def _unwritable_output_cases() -> list[Case]:
    """Outputs that cannot be written: /dev/full where a path is written, a file in the way."""
    f = {"f": "mine\n", "run.yaml": RUN + "lane: {provider: skypilot}\n"}
    outs = {
        "report": ["report", "{shared}", "--out"],
        "sky-task": ["sky-task", "{dir}/run.yaml", "--out"],
    }
    cases = []
    for cmd, head in outs.items():
        for where in ("{dir}", "{dir}/f", "{dir}/f/x", "/dev/full", "/dev/full/x", "/dev/null"):
            if cmd == "report" or where != "{dir}":  # sky-task writes into an existing folder
                # all bad: a user's file ({dir}/f) is never replaced either (item 9)
                cases.append(Case(f"item8/{cmd}/out={where}", [*head, where, "--json"], f))
    for where in ("/dev/full", "/dev/full/ev", "{dir}/f"):
        args = ["eval", "{shared}/config.yaml", "--set", f"eval.results_dir={where}", "--json"]
        cases.append(Case(f"item8/eval/results={where}", args, f))
    run = _small_run(
        "{train_file: {dir}/t.jsonl}", "output: {dir: {dir}/run, report_to: [tensorboard]}\n"
    )
    run = run.replace("output: {dir: {dir}/run}\n", "")
    files = {"run.yaml": run, "t.jsonl": REV_ROWS, "f": "x"}
    for value in ("/dev/full/tb", "{dir}/f"):  # the user's own folder for the tracker
        env = {"TENSORBOARD_LOGGING_DIR": value}
        args = ["train", "{dir}/run.yaml", "--json"]
        cases.append(Case(f"item8/train/tracker-{value}", args, files, env=env))
    return cases


def _plainly_bad_input_cases() -> list[Case]:
    """Every `item8/` case: a damaged base, bad templates and weights, unwritable outputs."""
    return [*_damaged_base_cases(), *_bad_template_and_weight_cases(), *_unwritable_output_cases()]


def _owned_cases() -> list[Case]:
    """Outputs pointed at what the user (or moetune) already owns: each must be refused,
    never overwritten – the adapter, the run dir, the base, a file of theirs."""
    argv = {
        "export/out-is-the-adapter": ["export", "{shared}/adapter", "--format", "merged",
                                      "--out", "{shared}/adapter", "--json"],
        "export/out-is-the-run": ["export", "{shared}", "--format", "merged",
                                  "--out", "{shared}", "--json"],
        "export/out-is-the-base": ["export", "{shared}", "--format", "merged",
                                   "--out", str(DEMO_BASE), "--json"],
        "export/out-a-users-file": ["export", "{shared}", "--format", "vllm",
                                    "--out", "{dir}/notes.txt", "--json"],
        "report/out-the-adapter-weights": ["report", "{shared}", "--out",
                                           "{shared}/adapter/adapter_model.safetensors"],
        "report/out-the-config": ["report", "{shared}", "--out", "{shared}/config.yaml"],
        "sky-task/out-the-run-yaml": ["sky-task", "{dir}/run.yaml", "--out", "{dir}/run.yaml"],
        "workflow/out-the-run-yaml": ["workflow", "github", "{dir}/run.yaml",
                                      "--out", "{dir}/run.yaml"],
        "quickstart/out-a-file": ["quickstart", "--out", "{dir}/notes.txt", "--json"],
        "quickstart/out-dev-full": ["quickstart", "--out", "/dev/full/qs", "--json"],
        "train/output-dir-the-base": ["train", "{dir}/base-out.yaml", "--json"],
        "train/ledger-is-a-dir": ["train", "{dir}/ledger-dir.yaml", "--json"],
    }  # fmt: skip
    files = {
        "run.yaml": RUN, "notes.txt": "mine\n", "t.jsonl": ROW * 4,
        "base-out.yaml": RUN + "data: {train_file: {dir}/t.jsonl}\n" + TRAIN
        + f"output: {{dir: {DEMO_BASE}}}\n",
        "ledger-dir.yaml": RUN + "data: {train_file: {dir}/t.jsonl}\n" + TRAIN
        + "output: {dir: {dir}/run, ledger: {dir}}\n",
    }  # fmt: skip
    return [Case(f"fresh/owned/{name}", args, files) for name, args in argv.items()]


def _input_cases() -> list[Case]:
    """Inputs of the right name and the wrong thing."""
    argv = {
        "eval/adapter-missing": ["eval", "{shared}/config.yaml", "--adapter", "/nonexistent"],
        "eval/adapter-empty-dir": ["eval", "{shared}/config.yaml", "--adapter", "{dir}/empty"],
        "eval/adapter-is-base": ["eval", "{shared}/config.yaml", "--adapter", str(DEMO_BASE)],
        "export/base-missing": ["export", "{shared}", "--format", "merged", "--base",
                                "/nonexistent", "--out", "{dir}/o"],
        "export/base-not-a-model": ["export", "{shared}", "--format", "merged", "--base",
                                    "{dir}/empty", "--out", "{dir}/o"],
        "export/items-missing": ["export", "{shared}", "--format", "merged", "--items",
                                 "/nonexistent.jsonl", "--out", "{dir}/o"],
        "inspect/config-is-dir": ["inspect", "{dir}/cfgdir", "--json"],
        "ledger/verify-dev-null": ["ledger", "verify", "--path", "/dev/null"],
        "gate/promote-garbage": ["gate", "{dir}/r.json", "--promote", "--json"],
        "serve-plan/quant-bogus": ["serve-plan", str(DEMO_BASE), "--quant", "q3_magic"],
        "serve-plan/kv-bogus": ["serve-plan", str(DEMO_BASE), "--kv-type", "fp2"],
        "serve-plan/card-bogus": ["serve-plan", str(DEMO_BASE), "--card", "abacus"],
        "launch/provider-bogus": ["launch", "{dir}/run.yaml", "--provider", "mars", "--dry-run"],
        "launch/resume-unknown": ["launch", "{dir}/run.yaml", "--resume", "no-such-run"],
        "train/set-unknown": ["train", "{dir}/run.yaml", "--set", "train.warp=9"],
        "train/max-steps-zero": ["train", "{dir}/run.yaml", "--set", "train.max_steps=0"],
        "data/set-bad-overlong": ["data", "{dir}/run.yaml", "--set", "data.overlong=shrug"],
    }  # fmt: skip
    files = {"run.yaml": RUN + "data: {train_file: {dir}/t.jsonl}\n", "t.jsonl": ROW * 4,
             "empty/.keep": "", "cfgdir/config.json/x": "", "r.json": "[[["}  # fmt: skip
    legal = {"ledger/verify-dev-null": "any"}  # an empty ledger verifies: 0 rows, none torn
    return [
        Case(f"fresh/input/{name}", args, files, legal.get(name, "bad"))
        for name, args in argv.items()
    ]


def fresh_cases() -> list[Case]:
    return [
        *_mixed_dir_stream_and_huge_row_cases(), *_secret_launch_promote_and_overwrite_cases(),
        *_plainly_bad_input_cases(),
        *_model_cases(), *_train_cases(), *_data_cases(), *_command_cases(),
        *_owned_cases(), *_input_cases(),
    ]  # fmt: skip
