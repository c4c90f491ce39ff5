"""The project's own demo model family: build it once, reuse it everywhere.

Owns: the presets (sizes, corpus caps, steps) for CPU, CUDA and tests; the build's stages
(tokenizer, target, draft distilled from the final target, small) each saved when done so a re-run
resumes; the cache check (a second build with the same settings does nothing); the family record
`DIR/family.json`; and where the family lives by default. Does not own: data
(`models/demo_data.py`), training and evaluation (`models/demo_train.py`), loading (`models/loader.py`).

Layout: `DIR/{target,draft,small}/` are standard `LlamaForCausalLM` folders (config, bfloat16
safetensors, the shared tokenizer, generation config); `DIR/tokenizer/` keeps the tokenizer alone;
`DIR/build_state.json` records finished stages; `DIR/family.json` is written last.

A build is budgeted in optimizer steps, never in wall time: the same settings give the same family
on a quiet machine and on a busy one (only later). `nominal_tokens_per_s` only estimates the time.
Weights are rounded to bfloat16 when a stage ends (before the next stage uses them as teacher), so
what is saved is exactly what was evaluated.

Where the family lives: `$SPECSERVE_DEMO_DIR` if set; else the family committed in the repository
(`demo-family/`, built on a GPU with the `cuda` preset, see its README), so a fresh checkout serves
with no training; else `~/.cache/specserve/demo-family`, built there on first use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from models.demo_data import CorpusConfig, collect_corpus, encode_files, train_tokenizer
from models.demo_train import (ModelShape, StagePlan, build_model, draft_from_target, evaluate,
                               greedy_sample, num_params, train, train_dtype)

RECIPE_VERSION = 2          # bump when a change to the recipe should invalidate built families
ROLES = ("target", "draft", "small")
SAMPLE_PROMPT = "def fibonacci(n):"


@dataclass(frozen=True)
class Preset:
    name: str
    corpus: CorpusConfig
    target: ModelShape
    draft_layers: tuple[int, ...]   # the draft copies these target layers, then is distilled
    small: ModelShape
    seq_len: int
    batch_size: int
    lr: float
    steps: tuple[int, int, int]     # optimizer steps of target, draft, small
    nominal_tokens_per_s: tuple[float, float, float]  # only for the time estimate printed first
    eval_tokens: int
    sample_tokens: int = 48


PRESETS = {
    "tiny": Preset(
        name="tiny", corpus=CorpusConfig(max_bytes=300_000, tokenizer_bytes=300_000, vocab_size=512,
                                         held_out_percent=10),
        target=ModelShape(2, 64, 128, head_dim=32), draft_layers=(0,),
        small=ModelShape(1, 64, 128, head_dim=32), seq_len=64, batch_size=8, lr=3e-3,
        steps=(120, 60, 60), nominal_tokens_per_s=(25_000, 25_000, 40_000), eval_tokens=2048,
        sample_tokens=16),
    "cpu": Preset(
        name="cpu", corpus=CorpusConfig(max_bytes=12_000_000, vocab_size=4096),
        target=ModelShape(4, 256, 688), draft_layers=(0,),
        small=ModelShape(2, 256, 688), seq_len=256, batch_size=8, lr=3e-3,
        steps=(1087, 453, 445), nominal_tokens_per_s=(5_500, 5_500, 9_000), eval_tokens=20_480),
    # The committed family: sized so that all three models in bfloat16 stay under 40 MB.
    "cuda": Preset(
        name="cuda", corpus=CorpusConfig(max_bytes=120_000_000, site_packages=True,
                                         tokenizer_bytes=20_000_000, vocab_size=4096),
        target=ModelShape(8, 320, 768), draft_layers=(0, 7),
        small=ModelShape(4, 256, 640), seq_len=512, batch_size=64, lr=2e-3,
        steps=(2400, 1200, 1600), nominal_tokens_per_s=(700_000, 600_000, 1_200_000),
        eval_tokens=65_536),
}


@dataclass(frozen=True)
class DemoSettings:
    """What determines the family. `threads` only changes float rounding, so it is not here."""
    preset: str = "cpu"
    seed: int = 0
    steps_scale: float = 1.0        # multiplies the preset's steps (quick builds, tests)
    device: str = "cpu"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; use one of {sorted(PRESETS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if not 0 < self.steps_scale <= 100:
            raise ValueError(f"steps_scale must be in (0, 100], not {self.steps_scale}")

    def steps(self, role_index: int) -> int:
        return max(1, round(PRESETS[self.preset].steps[role_index] * self.steps_scale))

    def estimate_s(self) -> float:
        """Training time on a machine that reaches the preset's nominal speed (an estimate only)."""
        preset = PRESETS[self.preset]
        tokens_per_step = preset.batch_size * preset.seq_len
        return sum(self.steps(i) * tokens_per_step / preset.nominal_tokens_per_s[i] for i in range(3))

    def record(self) -> dict:
        return {"preset": asdict(PRESETS[self.preset]), "seed": self.seed,
                "steps_scale": self.steps_scale, "device": self.device,
                "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "recipe": RECIPE_VERSION}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:16]


COMMITTED_DIR = Path(__file__).resolve().parents[1] / "demo-family"


def build_dir() -> Path:
    """Where `build-demo` writes by default: `$SPECSERVE_DEMO_DIR`, else the user's cache
    (never the committed family, which only a deliberate `--out demo-family` replaces)."""
    return Path(os.environ.get("SPECSERVE_DEMO_DIR") or "~/.cache/specserve/demo-family").expanduser().resolve()


def default_demo_dir() -> Path:
    """The family to serve: `$SPECSERVE_DEMO_DIR`, else the committed one, else the cache."""
    if os.environ.get("SPECSERVE_DEMO_DIR"):
        return build_dir()
    if (COMMITTED_DIR / "family.json").is_file():
        return COMMITTED_DIR
    return build_dir()


def is_complete(out: Path, settings_hash: str | None = None) -> bool:
    """family.json is there (with `settings_hash`, if given) and every model folder loads."""
    from models.loader import ModelLoadError, load_family

    try:
        family = json.loads((out / "family.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if settings_hash is not None and family.get("settings_hash") != settings_hash:
        return False
    try:
        load_family(out / "target", out / "draft", out / "small")
    except ModelLoadError:
        return False
    return True


@contextlib.contextmanager
def build_lock(out: Path):
    """One builder per folder: replicas that all call `ensure_demo_family` wait for the first."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_demo_family(out: str | Path | None = None, device: str = "cpu") -> Path:
    """The demo family's folder, built first (default settings) only if no complete family is there."""
    out = Path(out).expanduser() if out is not None else default_demo_dir()
    if is_complete(out):
        return out
    with build_lock(out):
        if not is_complete(out):
            preset = "cuda" if device == "cuda" else "cpu"
            build_demo_family(out, DemoSettings(preset=preset, device=device))
    return out


def _plan(settings: DemoSettings, role_index: int, seed_offset: int) -> StagePlan:
    preset = PRESETS[settings.preset]
    steps = settings.steps(role_index)
    return StagePlan(steps=steps, batch_size=preset.batch_size,
                     seq_len=preset.seq_len, lr=preset.lr, seed=settings.seed * 1000 + seed_offset,
                     warmup_steps=min(30, max(1, steps // 10)))


def _save(model, tokenizer, folder: Path) -> None:
    """Write a complete checkpoint folder atomically (a half-written one never looks finished)."""
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.to(torch.bfloat16)
    try:
        model.save_pretrained(staging)
    finally:
        model.to(torch.float32)
    tokenizer.save_pretrained(staging)
    for file in staging.iterdir():
        file.chmod(0o644)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def _load(folder: Path, device: torch.device):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()


class _State:
    """DIR/build_state.json: the settings hash and the record of each finished stage."""

    def __init__(self, out: Path, settings_hash: str):
        self.path = out / "build_state.json"
        try:
            state = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            state = {}
        if state.get("settings_hash") != settings_hash:
            for name in ("tokenizer", *ROLES):       # stale stages from other settings
                shutil.rmtree(out / name, ignore_errors=True)
            (out / "family.json").unlink(missing_ok=True)
            state = {"settings_hash": settings_hash, "stages": {}}
        self.state = state

    def done(self, stage: str, folder: Path) -> dict | None:
        return self.state["stages"].get(stage) if folder.is_dir() else None

    def finish(self, stage: str, record: dict) -> None:
        self.state["stages"][stage] = record
        self.path.write_text(json.dumps(self.state, indent=1))


def build_demo_family(out: str | Path, settings: DemoSettings, threads: int | None = None,
                      log=print) -> dict:
    """Run the stages not yet done for these settings; write and return family.json's record."""
    started = time.monotonic()
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[settings.preset]
    threads = threads or min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
    state = _State(out, settings.hash())
    steps = [settings.steps(i) for i in range(3)]
    log(f"building the demo family in {out} (preset {preset.name}, steps {steps} for target, "
        f"draft, small; {threads} threads, {device}); training alone takes about "
        f"{settings.estimate_s() / 60:.0f} min at the preset's nominal speed, longer on a busy machine")

    t0 = time.monotonic()
    data_threads = threads if device.type == "cpu" else (os.cpu_count() or 1)
    os.environ.setdefault("RAYON_NUM_THREADS", str(data_threads))   # tokenizers' thread pool
    corpus = collect_corpus(preset.corpus)
    tokenizer = _tokenizer(out, state, corpus, preset, data_threads)
    train_stream = encode_files(tokenizer, corpus.train)             # [num_train_tokens]
    held_stream = encode_files(tokenizer, corpus.held_out)           # [num_held_out_tokens]
    data_s = time.monotonic() - t0
    log(f"corpus: {len(corpus.train)} training files ({len(train_stream):,} tokens), "
        f"{len(corpus.held_out)} held out ({len(held_stream):,} tokens), {data_s:.1f} s")
    models = _trained_models(out, state, settings, tokenizer, train_stream, device, log)

    t0 = time.monotonic()
    metrics = evaluate(models, held_stream, preset.eval_tokens, preset.seq_len, device)
    sample = greedy_sample(models["target"], tokenizer, SAMPLE_PROMPT, preset.sample_tokens, device)
    eval_s = time.monotonic() - t0
    family = {
        "name": "specserve-demo", "settings_hash": settings.hash(), "settings": settings.record(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": threads, "train_dtype": train_dtype(device),
        "torch": torch.__version__,
        "corpus": {"roots": corpus.roots, "train_files": len(corpus.train),
                   "held_out_files": len(corpus.held_out), "train_bytes": corpus.train_bytes,
                   "held_out_bytes": corpus.held_out_bytes, "train_tokens": len(train_stream),
                   "held_out_tokens": len(held_stream)},
        "vocab_size": len(tokenizer),
        "shapes": {"target": preset.target.as_list(),
                   "draft": [len(preset.draft_layers), *preset.target.as_list()[1:]],
                   "small": preset.small.as_list()},
        "params": {role: num_params(model) for role, model in models.items()},
        **{role: state.state["stages"][role] for role in ROLES},
        "eval": metrics,
        "sample": {"prompt": SAMPLE_PROMPT, "greedy": sample},
        "seconds": {"data": round(data_s, 1), "eval": round(eval_s, 1),
                    **{role: state.state["stages"][role]["seconds"] for role in ROLES}},
        "total_s": round(time.monotonic() - started, 1),
    }
    (out / "family.json").write_text(json.dumps(family, indent=1))
    return family


def _tokenizer(out: Path, state: _State, corpus, preset, threads: int):
    """The family's tokenizer: trained on the training files, or read back when done."""
    from transformers import AutoTokenizer

    if state.done("tokenizer", out / "tokenizer"):
        return AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    tokenizer = train_tokenizer(corpus.train, preset.corpus, threads)
    tokenizer.save_pretrained(out / "tokenizer")
    state.finish("tokenizer", {"vocab_size": len(tokenizer)})
    return tokenizer


def _trained_models(out: Path, state: _State, settings: DemoSettings, tokenizer,
                    train_stream: torch.Tensor, device: torch.device, log) -> dict:
    """{role: model}: the target, then the draft (cut from the target's layers, distilled from
    it) and the small model, each trained and saved unless done, else read back."""
    preset = PRESETS[settings.preset]
    models = {}
    stages = {"target": (0, 1, None), "draft": (1, 2, "target"), "small": (2, 3, None)}
    for role, (index, seed_offset, teacher) in stages.items():
        folder = out / role
        if record := state.done(role, folder):
            models[role] = _load(folder, device)
            log(f"{role}: already trained ({record['steps']} steps), loaded")
            continue
        plan = _plan(settings, index, seed_offset)
        if role == "draft":
            model = draft_from_target(models["target"], list(preset.draft_layers), plan.seed)
        else:
            shape = preset.target if role == "target" else preset.small
            model = build_model(shape, len(tokenizer), plan.seed)
        record = train(model, train_stream, plan, device, desc=role,
                       teacher=models[teacher] if teacher else None)
        model.to(torch.bfloat16).to(torch.float32)      # what is saved is what is evaluated
        if role == "draft":
            record["init_layers"] = list(preset.draft_layers)
            record["loss"] = f"KL(target || draft) + {plan.ce_weight} x CE"
        _save(model, tokenizer, folder)
        state.finish(role, record)
        models[role] = model
        log(f"{role}: {record['steps']} steps, {record['tokens']:,} tokens in {record['seconds']} s "
            f"({record['tokens_per_s']} tokens/s), train loss {record['train_loss']}")
    return models
