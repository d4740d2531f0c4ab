"""Fresh cases of benchmarks/cli_sweep.py (issue 36's third pass): what a new user types
next – models whose config.json is wrong in a plausible way, runs pointed at the wrong
things, flags of the commands the earlier blocks did not reach, data that is legal but
unusual. Each is a `Case` of sweep_cases.py; {dir} is the case's scratch dir."""

from __future__ import annotations

import json

from sweep_cases import DEMO_BASE, RUN, Case

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


def fresh_cases() -> list[Case]:
    return [*_model_cases(), *_train_cases(), *_data_cases(), *_command_cases()]
