"""The commands of README.md and of the pages under docs/, run the way a new user pastes them, so they cannot
rot; and their relative links, followed, so they cannot break.

Every line of every ```bash block in README.md and docs/*.md is either run here or listed in SKIPPED with its
reason; test_every_readme_command_is_classified fails on a line that is neither, so a new command has to be
classified. How each kind runs (from the repository root, with `.venv/bin/` replaced by the directory of the
interpreter running this test, the README's convention being `.venv/bin/python` / `.venv/bin/torchrun`):

- training (`.venv/bin/python train.py ...`, `make train`, `torchrun --standalone` of 2 processes, at most
  MAX_MULTIPROCESS of those): the README's own overrides, then a 2-block model on a generated corpus
  (tests/helpers.py TINY_TRAINER, at the README's trainer.seq_len where it gives one) for
  2-4 steps (trainer.max_steps N becomes clamp(round(N / 300), 2, 4), so a longer run in the README is a
  longer run here: "extend" extends), no evaluation, sample or wandb; then that step's checkpoint must exist;
- `python -m kimi.generate ...`: against the run the README trained in that run dir; the text must start with
  the prompt;
- `python -m kimi.eval ...`: against the run the README trained in that run dir (the shipped tasks, no hub);
  it must print that checkpoint's step and a score per task and metric;
- `python -m kimi.summary ...`, `--help` lines and `ls`: as written;
- `python -m kimi.ablate report ...`: in a copy of the package, configs, committed ablation records and
  docs/ablations.md, whose report files (and, with --docs, the page's results section) are removed first:
  they must come back byte for byte;
- `make test ...` (running it would run this suite) and `make train ARGS=...` (`make train` itself runs):
  `make -n`, whose recipe must be pytest / train.py with exactly those arguments.

Relative paths (run dirs, `ls` arguments) are mapped into a temporary directory, the same README path to the
same temporary path, so `kimi.generate run=runs/first` samples what `train.py hydra.run.dir=runs/first`
trained. Caches (HF, kimi) are temporary and offline.

Every relative link of those pages (`[text](path)`, `![alt](path)`, outside code) must name a file or
directory of the repository, and a `#fragment` a heading of the page it points to."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_TRAINER, make_corpus

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent  # what `.venv/bin/` stands for
VENV = BIN.parent

# README and docs lines not run here, each with why. Keys: the line without its comment, quoted as shlex.join
# quotes (test_every_readme_command_is_classified prints a new line in this form).
GPUS_8 = "8 processes (8 GPUs)"
FT_JOBS = ("a lighthouse and two replica groups running at once, each waiting on the others; "
           "tests/parallel/test_fault_tolerance.py runs them (a lighthouse, two one-process groups, one "
           "killed and started again)")
HUB_TASKS = ("downloads the tasks' data from the Hugging Face hub, which tests do not reach; docs/eval.md's "
             "first command runs the same command on the shipped tasks")
PLAN_64 = ("the planner's search of 64 GPUs takes about a minute on 2 cores with the real memory and "
           "communication models (docs/planning.md, Speed); tests/plan/test_plan.py runs the same command "
           "against stand-in models and checks every column")
PARTS = ("a corpus on storage shared by several machines; tests/data/test_prepare_workers.py runs the "
         "tokenizer step, the workers, the merge and the datatrove executor on a generated corpus and "
         "compares the bytes with one process's")
SKIPPED = {
    ".venv/bin/python -m kimi.plan model=kimi_linear_48b_a3b cluster.gpus=64 cluster.gpu=h200 "
    "trainer.seq_len=4096 trainer.tokens_per_step=4194304 top=5 json=plan.json": PLAN_64,
    "make test": "runs the whole suite, this file included (minutes); `make test PYTEST_ARGS=...` is checked "
                 "with make -n",
    ".venv/bin/python train.py model=small trainer.precision=bf16 hydra.run.dir=runs/small":
        "the First hour's GPU step: on CPU it would repeat step 1's run",
    ".venv/bin/python train.py model=small data=files 'data.data_files=[corpus/*.jsonl]' "
    "trainer.precision=bf16 trainer.max_steps=20000 hydra.run.dir=runs/mine-small":
        "Your own data's GPU-sized line: on CPU it would repeat the CPU line's run above it (run here); "
        "test_own_data_example_fits_a_small_corpus checks the tokenizer size each line trains",
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py parallel.dp_shard=8 "
    "hydra.run.dir=runs/fsdp8": GPUS_8,
    ".venv/bin/torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint '$HEAD:29500' "
    "--rdzv_id kimi train.py parallel.dp_replicate=2 parallel.tp=2 hydra.run.dir=runs/two_nodes":
        "two nodes: tests/parallel/test_multinode.py runs this line as two agents meeting at HEAD=127.0.0.1",
    ".venv/bin/torchrun --standalone --nproc_per_node 2 train.py parallel.dp_replicate=2 "
    "hydra.run.dir=runs/exp2": "a second 2-process launch (~10 s; one is the budget, the First hour's runs); "
                               "tests/parallel/test_parallel.py checks dp_replicate=2 against one process",
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py model=1b parallel.tp=2 parallel.dp_shard=4 "
    "hydra.run.dir=runs/exp3": GPUS_8,
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py model=1b parallel.pp=2 parallel.dp_shard=4 "
    "parallel.pp_microbatches=8 trainer.micro_batch_size=8 hydra.run.dir=runs/exp4": GPUS_8,
    ".venv/bin/python bench/parallel.py --layouts single --model 1b --batch 4 --set trainer.seq_len=4096 "
    "trainer.precision=bf16": "a GPU benchmark: the 1b model at 4096 tokens in bf16",
    ".venv/bin/python bench/peer.py --titan --batch 4 --steps 10 --set trainer.seq_len=4096 "
    "trainer.precision=bf16 parallel.compile=true":
        "a GPU benchmark: 1b, dense_1b and torchtitan at 4096 tokens compiled in bf16 "
        "(tests/project/test_gpu_check.py runs its CPU dry run at tiny shape)",
    "make gpu-check": "needs a CUDA GPU (its dry run is the next line)",
    "make gpu-check GPU_CHECK_ARGS=--dry-run": "tests/project/test_gpu_check.py runs it (about a minute)",
    "make gpu-check GPU_CHECK_ARGS=--plan": "tests/project/test_gpu_check.py runs bench/gpu_check.py --plan "
                                            "and checks its table against docs/gpu.md's",
    "make gpu-wheels": "downloads from the package index",
    ".venv/bin/python -m kimi.data.prepare data=files 'data.data_files=[corpus/*.jsonl]' data.num_proc=16":
        "needs a corpus of one's own; tests/data/test_prepare_cli.py runs the command on a generated corpus, "
        "then the trainer's prepare, which must find what it wrote",
    ".venv/bin/python -m kimi.data.prepare data=files 'data.data_files=[/shared/corpus/*.jsonl]' "
    "data.cache_dir=/shared/kimi-cache data.prepare_workers=64": PARTS,
    ".venv/bin/python -m kimi.data.prepare data=files 'data.data_files=[/shared/corpus/*.jsonl]' "
    "data.cache_dir=/shared/kimi-cache data.prepare_workers=64 data.prepare_worker=7": PARTS,
    ".venv/bin/python -m kimi.data.prepare data=files 'data.data_files=[/shared/corpus/*.jsonl]' "
    "data.cache_dir=/shared/kimi-cache data.prepare_workers=64 data.prepare_executor=local": PARTS,
    ".venv/bin/python -m kimi.ablate all":
        "the whole ablation study (hours); tests/run/test_ablate.py runs one experiment end to end at 2 "
        "steps, reruns it (nothing trained) and reports it",
    ".venv/bin/python train.py -m +experiment=ablate_residual":
        "Hydra's multirun of a whole experiment (9 runs of 600 steps); tests/run/test_ablate.py runs it at 2 "
        "steps with trainer.seed=1",
    ".venv/bin/python -m kimi.ablate ablate_mixer 'arms=[all_mla,hybrid_3to1]' root=runs/ablate_rope16 "
    "out=bench/results/ablations/rope16 -- model.mla.qk_rope_head_dim=16":
        "6 runs of 600 steps (20 minutes); tests/run/test_ablate.py runs the runner end to end at 2 steps "
        "with --root, --out and overrides, and a study limited to some arms",
    ".venv/bin/python -m kimi.dashboard 'runs=[runs/ablate/ablate_residual/standard_seed1,"
    "runs/ablate/ablate_residual/attnres_block_seed1]' out=dashboard.png":
        "needs the study's runs; tests/run/test_dashboard.py draws a trained run and one with every "
        "diagnostic key with the same command",
    ".venv/bin/python -m kimi.convert to-hf 'run=outputs/<date>/<time>' out=hf_out":
        "a placeholder run dir; tests/interop/test_hf_interop.py converts a trained run with the same "
        "command and loads it in transformers",
    ".venv/bin/python -c 'from kimi.convert import load_hf; model = load_hf('\"'\"'hf_dir'\"'\"')'":
        "a placeholder directory; tests/interop/test_hf_interop.py loads save_pretrained's output with "
        "load_hf",
    ".venv/bin/python -m kimi.eval run=runs/first hf=hf_first limit=50 trust_remote_code=true":
        "needs the run exported with kimi.convert to-hf; tests/interop/test_eval.py runs the same command "
        "on a trained tiny run and a Kimi-Linear-like one and their exports, and compares the two sets of "
        "scores",
    ".venv/bin/python -m kimi.eval run=runs/first tasks=hellaswag,arc_easy,arc_challenge limit=500":
        HUB_TASKS,
    ".venv/bin/python -m kimi.eval run=runs/first tasks=mmlu num_fewshot=5": HUB_TASKS,
    ".venv/bin/python -m kimi.convert to-hf run=runs/qat out=hf_qat mxfp4_experts=true":
        "tests/precision/test_low_precision_train.py exports a QAT run with the same command and loads it "
        "back, its forward equal to the trained one's",
    ".venv/bin/python -m kimi.convert to-hf run=runs/k3 out=k3_out layout=k3":
        "a placeholder run; tests/interop/test_k3_checkpoint.py runs the same command on a trained run with "
        "K3's parts and reads the output back bit for bit (and mlx-lm reads that layout)",
    ".venv/bin/python -m kimi.convert from-hf hf=hf_dir run=runs/from_hf":
        "a placeholder directory; tests/interop/test_hf_interop.py runs from-hf on save_pretrained's output, "
        "samples from the run and trains from it with the printed command",
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py model=moe_tiny parallel.dp_shard=8 "
    "parallel.ep=4 hydra.run.dir=runs/exp5":
        GPUS_8 + "; tests/parallel/test_parallel.py checks ep 2 and ep 2 over dp_shard 4",
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py parallel.engine=deepspeed "
    "parallel.deepspeed.zero_stage=2 parallel.dp_shard=8 hydra.run.dir=runs/ds8":
        GPUS_8 + "; tests/parallel/test_deepspeed.py runs ZeRO 1, 2 and 3 on 2 ranks against one process",
    ".venv/bin/torchrun --standalone --nproc_per_node 8 train.py model=1b parallel.cp=4 parallel.dp_shard=2 "
    "trainer.seq_len=65536 trainer.micro_batch_size=1 parallel.activation_checkpointing=full "
    "trainer.precision=bf16 hydra.run.dir=runs/cp4":
        GPUS_8 + "; tests/parallel/test_parallel.py checks cp 4 and cp 2 x dp_shard 2 against one process",
    "docker build -f docker/Dockerfile -t kimi .":
        "no container engine here; tests/project/test_docker.py checks the Dockerfile's copied paths and "
        "entrypoint against this line",
    "docker run --gpus all --rm -v '$PWD/runs:/kimi/runs' kimi model=small trainer.precision=bf16 "
    "hydra.run.dir=runs/small": "a CUDA host with a container engine; tests/project/test_docker.py checks "
                                "that its overrides compose and its run directory is in the mounted volume",
    ".venv/bin/deepspeed --no_local_rank --num_gpus 8 train.py parallel.engine=deepspeed parallel.dp_shard=8 "
    "hydra.run.dir=runs/ds8":
        GPUS_8 + "; tests/parallel/test_deepspeed.py runs the same launcher with --num_gpus 2 on CPU",
    ".venv/bin/torchft_lighthouse --min_replicas 1 --bind '[::]:29510'": FT_JOBS,
    "REPLICA_GROUP=0 NPROC=2 LIGHTHOUSE=http://localhost:29510 launch/torchft.sh group parallel.dp_shard=2":
        FT_JOBS,
    "REPLICA_GROUP=1 NPROC=2 LIGHTHOUSE=http://localhost:29510 launch/torchft.sh group parallel.dp_shard=2":
        FT_JOBS,
}
MAX_MULTIPROCESS = 2  # 2-process torchrun launches run here (each 10-20 s on 2 CPU cores)

TINY_KEYS = {w.split("=", 1)[0] for w in TINY_TRAINER}
SET_HERE = {"trainer.max_steps", "trainer.eval_every", "trainer.sample_tokens", "trainer.peak_flops",
            "hydra.run.dir", "data", "data.data_files", "data.cache_dir"} | TINY_KEYS
KEPT_HERE = {"trainer.seq_len"}  # the README's own: its context-parallel example splits 256-token rows
RUN_DIR_FILES = {"metrics.jsonl", "loss_curve.png", "checkpoints", "train.log", "tokenizer.model"}


def pages() -> list[Path]:
    """The pages whose commands and links are checked: README.md, then docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def page_commands(page: Path) -> list[str]:
    """The commands of a page's ```bash blocks in order: continuations joined, comments dropped, each as
    shlex.join of its words (what a shell would pass on)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.M | re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(page relative to the repository root, command) for every page, README.md's first."""
    return [(str(page.relative_to(ROOT)), c) for page in pages() for c in page_commands(page)]


def readme_commands() -> list[str]:
    """Every page's commands in order (README.md's first): the README and docs/ are one set of instructions,
    whose run dirs are shared (a docs line may sample a run a README line trained)."""
    return [c for _, c in documented_commands()]


def kind(command: str) -> str | None:
    """How a README command is checked here (see the module's docstring); None: not classified."""
    if command in SKIPPED:
        return "skip"
    words = shlex.split(command)
    prog, rest = words[0], words[1:]
    if prog == "make":
        targets = [w for w in rest if "=" not in w and not w.startswith("-")]
        target = targets[0] if targets else ""
        if target == "train":
            return "make-dry" if _arg(rest, "ARGS") else "make-train"
        return "make-dry" if target == "test" else None
    if prog == ".venv/bin/python":
        if "--help" in rest or "-h" in rest:
            return "help"
        if rest[:1] == ["train.py"]:
            return "train"
        if rest[:2] == ["-m", "kimi.generate"]:
            return "generate"
        if rest[:2] == ["-m", "kimi.summary"]:
            return "summary"
        if rest[:2] == ["-m", "kimi.eval"]:
            return "eval"
        if rest[:3] == ["-m", "kimi.ablate", "report"]:
            return "ablate-report"
    if prog == ".venv/bin/torchrun" and "--standalone" in rest and _value(rest, "--nproc_per_node") == "2":
        return "torchrun"
    if prog == "ls":
        return "ls"
    return None


def _value(words: list[str], flag: str) -> str | None:
    """The value of --flag VALUE or of its key=value spelling (flag's name without dashes)."""
    key = flag.lstrip("-").replace("-", "_") + "="
    return next((words[i + 1] for i, w in enumerate(words[:-1]) if w == flag), None) or next(
        (w[len(key):] for w in words if w.startswith(key)), None)


def _key(word: str) -> str:
    return word.split("=", 1)[0].lstrip("+~") if "=" in word else ""


def _arg(words: list[str], key: str) -> str | None:
    return next((w.split("=", 1)[1] for w in words if _key(w) == key), None)


def _tiny_steps(words: list[str]) -> int:
    n = _arg(words, "trainer.max_steps")
    return 2 if n is None else max(2, min(4, round(int(n) / 300)))


@pytest.mark.unit
def test_every_readme_command_is_classified():
    commands = readme_commands()
    assert len(page_commands(README)) >= 10, "README.md has lost its ```bash blocks?"
    assert {"make train", "make test"} <= set(page_commands(README)), (
        "README.md's Quick start must keep `make train` and `make test`, the two commands a fresh machine "
        "needs")
    bare = [f"{page}: {c}" for page, c in documented_commands()
            if c.split()[0] in ("python", "python3", "torchrun", "pip")]
    assert not bare, (f"README and docs commands must use the venv's programs (.venv/bin/python, "
                      f".venv/bin/torchrun), as the README's Quick start says: {bare}")
    unclassified = [f"{page}: {c}" for page, c in documented_commands() if kind(c) is None]
    assert not unclassified, ("README or docs commands neither run by tests/project/test_readme.py nor in "
                              "its SKIPPED list (add each to SKIPPED with a reason, or teach kind() to run "
                              "it):\n" + "\n".join(unclassified))
    stale = [c for c in SKIPPED if c not in commands]
    assert not stale, f"SKIPPED names commands neither the README nor docs/ has any more: {stale}"
    multi = [c for c in commands if kind(c) == "torchrun"]
    assert len(multi) <= MAX_MULTIPROCESS, f"more 2-process launches than the time budget allows: {multi}"


def _slug(heading: str) -> str:
    """The anchor a heading gets: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _uncoded(page: Path) -> str:
    """The page without its fenced code blocks (whose `#` lines are comments, not headings)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)


def _prose(page: Path) -> str:
    """The page without its code, fenced or inline, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", _uncoded(page))


def anchors(page: Path) -> set[str]:
    """The #fragments a page's headings answer to (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _uncoded(page), flags=re.M):
        slug = _slug(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    """The targets of a page's links and images that point into the repository (no scheme)."""
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(page))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, flags=re.I)]


@pytest.mark.unit
@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(page):
    """Every relative link of README.md and docs/*.md names a file or directory of the repository, and its
    #fragment a heading of the page it points to (a page's own headings for a bare #fragment)."""
    links = relative_links(page)
    assert page != README or len(links) >= 10, "README.md has lost its links to docs/?"
    broken = []
    for link in links:
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif not target.resolve().is_relative_to(ROOT):
            broken.append(f"{link}: outside the repository")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: {target.relative_to(ROOT)} has no heading #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


@pytest.mark.unit
def test_link_checker_sees_links_and_headings(tmp_path):
    """The checker's own parsing: links in prose are found, links in code are not, anchors follow headings."""
    page = tmp_path / "page.md"
    page.write_text("# A page: its title\n\n## Runs, and more\n\nSee [x](other.md#a-b) and ![i](img/p.png).\n"
                    "`[not](a link)` and [mail](mailto:someone).\n\n```bash\n# not a heading [n](x)\n```\n"
                    "## Runs, and more\n### 5. Experts (`kimi/model/moe.py`)\n")
    assert relative_links(page) == ["other.md#a-b", "img/p.png"]
    assert anchors(page) == {"a-page-its-title", "runs-and-more", "runs-and-more-1",
                             "5-experts-kimimodelmoepy"}


class Sandbox:
    """Runs README commands: temporary run dirs, caches and corpus; remembers which run dirs were trained."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        corpus = make_corpus(tmp / "corpus")
        files = ",".join(str(p) for p in sorted(corpus.glob("*.txt")))
        self.data = ["data=files", f"data.data_files=[{files}]", f"data.cache_dir={tmp / 'cache'}"]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
                    "HF_HOME": str(tmp / "hf"), "KIMI_CACHE_DIR": str(tmp / "kimi"), "OMP_NUM_THREADS": "1"}
        for var in ("TRITON_INTERPRET", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # as a user's shell has them
            self.env.pop(var, None)
        self.trained: dict[Path, int] = {}  # run dir -> its last trained step
        self.fresh = 0

    def path(self, readme_path: str) -> Path:
        """A README path (relative to the repository root) in the sandbox."""
        p = Path(readme_path)
        return p if p.is_absolute() else self.tmp / "root" / p

    def run(self, argv: list[str], timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (f"exit code {proc.returncode}: {shlex.join(argv)}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def tiny(self, overrides: list[str]) -> tuple[list[str], Path, int]:
        """The README's overrides as a 2-4 step run of the tiny model on the generated corpus."""
        steps = _tiny_steps(overrides)
        given = _arg(overrides, "hydra.run.dir")
        if given is None:
            self.fresh += 1
        run = self.path(given) if given else self.tmp / "fresh" / str(self.fresh)
        kept = [w for w in overrides if _key(w) not in SET_HERE - KEPT_HERE]
        # the run dir the README describes, loss curve included (RUN_DIR_FILES): logging.plot as a user has it
        tiny = [w for w in TINY_TRAINER if _key(w) not in {_key(k) for k in kept} | {"logging.plot"}]
        # peak_flops: MFU's denominator given, not measured (saves a second per run)
        return ([*kept, *tiny, *self.data, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                 "trainer.sample_tokens=0", "trainer.peak_flops=1e11", f"hydra.run.dir={run}"], run, steps)

    def trained_at(self, run: Path, steps: int) -> None:
        ckpt = run / "checkpoints" / f"step_{steps:08d}"
        assert ckpt.is_dir(), f"no checkpoint {ckpt.name} in {run}: {sorted(p.name for p in run.glob('*/*'))}"
        self.trained[run] = steps

    def clone(self) -> Path:
        """The package, its configs, the committed ablation records and reports and their docs page, copied
        (once): what `kimi.ablate report` reads and writes, as in a fresh clone (records, no run dirs)."""
        clone = self.tmp / "clone"
        if not clone.exists():
            for rel in ("kimi", "conf", "bench/results/ablations", "docs/ablations.md"):
                copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy
                (clone / rel).parent.mkdir(parents=True, exist_ok=True)
                copy(ROOT / rel, clone / rel)
        return clone

    def ensure_trained(self, readme_run: str) -> Path:
        """The run dir of a README path; trained by the README's first command for it if not yet done."""
        run = self.path(readme_run)
        if run not in self.trained:
            first = next((c for c in readme_commands() if kind(c) == "train"
                          and _arg(shlex.split(c), "hydra.run.dir") == readme_run), None)
            assert first, f"no README training command has hydra.run.dir={readme_run}"
            check(self, first)
        return run


def check(box: Sandbox, command: str) -> None:
    words = shlex.split(command)
    how = kind(command)
    exe = [str(BIN / Path(words[0]).name)] if words[0].startswith(".venv/bin/") else [words[0]]
    if how == "train":
        argv, run, steps = box.tiny(words[2:])
        box.run([*exe, words[1], *argv])
        box.trained_at(run, steps)
    elif how == "torchrun":
        script = words.index("train.py")
        argv, run, steps = box.tiny(words[script + 1:])
        box.run([*exe, *words[1:script + 1], *argv], timeout=600)
        box.trained_at(run, steps)
    elif how == "make-train":
        if shutil.which("make") is None:
            pytest.skip("no make on this machine")
        args = _arg(words, "ARGS") or ""
        argv, run, steps = box.tiny(shlex.split(args))
        rest = [w for w in words[1:] if _key(w) != "ARGS"]
        box.run(["make", "-o", f"{VENV}/.installed", f"VENV={VENV}", *rest, f"ARGS={shlex.join(argv)}"])
        box.trained_at(run, steps)
    elif how == "make-dry":
        if shutil.which("make") is None:
            pytest.skip("no make on this machine")
        stamps = ["-o", f"{VENV}/.installed", "-o", f"{VENV}/.installed-dev"]  # never (re)install here
        out = box.run(["make", "-n", *stamps, f"VENV={VENV}", *words[1:]]).stdout
        if "test" in words:
            expected = (f"{VENV}/bin/python -m pytest -q -n 2 --dist loadfile "
                        f"{_arg(words, 'PYTEST_ARGS') or ''}").strip()
        else:
            expected = f"{VENV}/bin/python train.py {_arg(words, 'ARGS') or ''}".strip()
        assert out.strip() == expected, f"make -n printed {out!r}, expected {expected!r}"
    elif how == "generate":
        run = box.ensure_trained(_arg(words, "run"))
        argv = [f"run={run}" if _key(w) == "run" else w for w in words[3:]]
        out = box.run([*exe, "-m", "kimi.generate", *argv]).stdout
        prompt = _arg(words, "prompt") or "ROMEO:"  # kimi.generate's default
        header, _, text = out.partition("\n")
        assert re.fullmatch(rf"\[kimi\] step {box.trained[run]} checkpoint, [1-9]\d* tokens:", header), out
        assert text.startswith(prompt) and len(text.rstrip()) > len(prompt), (
            f"the README's generate example should print text starting with its prompt {prompt!r}: {out!r}")
    elif how == "eval":
        run = box.ensure_trained(_arg(words, "run"))
        argv = [f"run={run}" if _key(w) == "run" else w for w in words[3:]]
        out = box.run([*exe, "-m", "kimi.eval", *argv]).stdout
        header, _, scores = out.partition("\n")
        assert header == f"[kimi] step {box.trained[run]} checkpoint of {run}:", out
        assert re.search(r"^kimi_cloze +acc +[\d.]+$", scores, re.M), out
    elif how == "ablate-report":
        report_from_records(box, exe, words)
    elif how in ("summary", "help"):
        out = box.run([*exe, *words[1:]]).stdout
        assert out.strip(), f"{command} printed nothing"
    elif how == "ls":
        paths = [w for w in words[1:] if not w.startswith("-")]
        runs = [p for p in paths if any(kind(c) == "train" and _arg(shlex.split(c), "hydra.run.dir") == p
                                        for c in readme_commands())]
        for p in runs:
            box.ensure_trained(p)
        flags = [w for w in words[1:] if w.startswith("-")]
        out = box.run([words[0], *flags, *(str(box.path(p)) for p in paths)])
        assert out.stdout.strip(), f"{command} listed nothing"
        for p in runs:  # what the First hour says a run dir holds
            missing = RUN_DIR_FILES - {q.name for q in box.path(p).iterdir()}
            assert not missing, f"{p} lacks {sorted(missing)}:\n{out.stdout}"
    else:
        raise AssertionError(f"{command}: not classified ({how})")


def report_from_records(box: Sandbox, exe: list[str], words: list[str]) -> None:
    """The report regenerated in a copy of the repository, its committed outputs removed first (with --docs
    the page's results section emptied too), comes back byte for byte: tables, plots, section, page."""
    from kimi.ablate.report import SECTION_BEGIN, SECTION_END

    clone, out = box.clone(), _value(words, "--out") or "bench/results/ablations"
    written = sorted(p.relative_to(clone) for p in (clone / out).iterdir() if p.is_file())
    assert any(p.suffix == ".json" for p in written) and any(p.suffix == ".png" for p in written), written
    for rel in written:
        (clone / rel).unlink()
    if "--docs" in words or "docs=true" in words:
        written.append(Path("docs/ablations.md"))
        page = clone / written[-1]
        text = page.read_text()
        page.write_text(text[:text.index(SECTION_BEGIN) + len(SECTION_BEGIN)] + "\n"
                        + text[text.index(SECTION_END):])
    box.run([*exe, *words[1:]], cwd=clone)
    differ = [str(rel) for rel in written if not (clone / rel).is_file()
              or (clone / rel).read_bytes() != (ROOT / rel).read_bytes()]
    assert not differ, f"{shlex.join(words)} does not reproduce the committed {differ}: rerun it and commit"


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("readme"))


COMMANDS = documented_commands()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("page,command", COMMANDS,
                         ids=[f"{i:02d}-{Path(p).stem}-{' '.join(c.split()[:3])}"
                              for i, (p, c) in enumerate(COMMANDS)])
def test_readme_command_runs(box, page, command):
    """In page order (README.md first), so a generate or ls line finds the run its neighbours trained (a line
    picked alone with -k trains what it needs). Skipped lines show their reason in pytest's summary."""
    if kind(command) == "skip":
        pytest.skip(f"{page}: {command}: {SKIPPED[command]}")
    check(box, command)


# ------------------------------------------------------------------------------- the README's own numbers
# Sizes and counts the README states are recomputed here (times and losses are measurements: the README
# says on which machine and with which command, and nothing asserts them).

SCALE = {"k": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _same_figure(figure: str, n: float) -> bool:
    """Whether the README's figure ("125.6M", "2.78T", "942,848") is n written to the figure's precision."""
    if figure[-1] in SCALE:
        digits = figure[:-1]
        decimals = len(digits.partition(".")[2])
        return f"{n / SCALE[figure[-1]]:.{decimals}f}" == digits
    return int(figure.replace(",", "")) == n


def _summary(*overrides: str):
    from kimi.summary import compose_config, summarize

    return summarize(compose_config(list(overrides)))


@pytest.mark.unit
@pytest.mark.slow
def test_readme_preset_sizes_are_what_kimi_summary_counts():
    """The Configuration table's preset sizes (and the First hour's GPU step) are kimi.summary's totals and
    active counts, with the vocabulary the table's note names (about 10 s: kimi_k3 is sized on meta)."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `model` |"))
    presets, note = row.split("|")[2], row.split("|")[3]
    small_vocab = set(re.findall(r"`(\w+)`", note.split("vocabulary for", 1)[1].split(" and 32000")[0]))
    assert {"tiny", "moe_tiny"} <= small_vocab, note
    sized = re.findall(r"`(\w+)` \(([^)]*)\)", presets)
    assert len(sized) >= 8, presets
    wrong = []
    for name, inside in sized:
        s = _summary(f"model={name}", f"data.tokenizer.vocab_size={2048 if name in small_vocab else 32000}")
        for figure, what in re.findall(r"(\d[\d.]*[kMBT])((?: active)?(?: without the embedding)?)", inside):
            n = {"": s.total, " active": s.active,
                 " active without the embedding": s.active - s.families["embedding"]}[what]
            if not _same_figure(figure, n):
                wrong.append(f"{name}: README {figure}{what}, kimi.summary {n:,}")
    step7 = re.search(r"here `small` \((\S+) parameters with this (\d+)-piece vocabulary\)", text)
    assert step7, "the First hour's GPU step should say the small model's size with Shakespeare's vocabulary"
    s = _summary("model=small")
    assert s.cfg.model.vocab_size == int(step7[2])
    if not _same_figure(step7[1], s.total):
        wrong.append(f"First hour step 7: README {step7[1]}, kimi.summary {s.total:,}")
    assert not wrong, ("README.md's parameter counts differ from python -m kimi.summary's:\n"
                       + "\n".join(wrong))


@pytest.mark.unit
def test_readme_default_run_numbers_are_the_default_configs():
    """What the README says the default run trains (tokenizer, model, steps, batch) and the banner lines it
    shows (parameters, FLOPs, vocabulary, the optimizer's split) are those of the default config."""
    text = README.read_text()
    s = _summary()
    cfg, t = s.cfg, s.cfg.trainer
    said = re.search(r"trains\s+a (\d+)-piece BPE tokenizer.*?the `(\w+)` model \((\S+) parameters, "
                     r".*?for (\d+) steps of (\d+) x (\d+) tokens", text, re.S)
    assert said, "README's 'What the default run does' no longer says what it trains"
    assert int(said[1]) == cfg.data.tokenizer.vocab_size and said[2] == cfg.model.name
    assert _same_figure(said[3], s.total), (said[3], s.total)
    assert (int(said[4]), int(said[5]), int(said[6])) == (t.max_steps, t.micro_batch_size, t.seq_len)
    banner = re.search(r"\[kimi\] model \w+: (\S+) parameters \((\S+) embedding\).* vocab (\d+), ([\d.]+) "
                       r"MFLOP/token", text)
    assert banner and _same_figure(banner[1], s.total) and _same_figure(banner[2], s.families["embedding"])
    assert int(banner[3]) == cfg.model.vocab_size and f"{s.flops_per_token / 1e6:.1f}" == banner[4]
    opt = re.search(r"muon: (\d+) tensors, ([\d,]+) params; adamw: (\d+) tensors, ([\d,]+) params", text)
    assert opt and _same_figure(opt[2], s.muon) and _same_figure(opt[4], s.adamw), (opt and opt[0], s.muon)
    assert int(opt[1]) + int(opt[3]) == len(list(s.model.parameters()))
    data = re.search(r"batch (\d+)x(\d+)x(\d+) = ([\d,]+) tokens/step", text)
    assert data and int(data[4].replace(",", "")) == s.tokens_per_step == t.micro_batch_size * t.seq_len


def _own_data_lines() -> tuple[str, str]:
    """The README's two 'Your own data' training commands: (the CPU one, the GPU-sized one)."""
    section = README.read_text().split("## Your own data", 1)[1].split("\n## ", 1)[0]
    lines = [c for c in page_commands_of(section) if "train.py" in c]
    assert len(lines) == 2, lines
    return lines[0], lines[1]


def page_commands_of(markdown: str) -> list[str]:
    """The commands of the ```bash blocks of a piece of Markdown, continuation lines joined, comments off."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        out += [line.split(" #")[0].strip() for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return out


@pytest.mark.unit
def test_own_data_example_fits_a_small_corpus(tmp_path):
    """The CPU example's tokenizer can be trained on a small corpus (this repository's docs/*.md, a few
    hundred kB), and its model is the CPU-sized default; the GPU-sized one's (the files preset's size) cannot
    be filled by that corpus, and the README says so and labels that line as a GPU's."""
    from kimi.data.sources import DataError
    from kimi.data.tokenizer import train_tokenizer

    cpu, gpu = _own_data_lines()
    words = shlex.split(cpu)
    vocab = int(_arg(words, "data.tokenizer.vocab_size") or 0)
    assert vocab and _arg(words, "model") is None and _arg(words, "trainer.max_steps") is None, cpu
    texts = [p.read_text() for p in sorted(DOCS.glob("*.md"))]
    assert train_tokenizer(texts, vocab, tmp_path / "cpu.model").vocab_size == vocab
    files = _summary("data=files").cfg
    # the GPU line keeps the preset's size, which docs/ cannot fill
    assert _arg(shlex.split(gpu), "data.tokenizer.vocab_size") is None
    with pytest.raises(DataError, match="lower it for a small corpus"):
        train_tokenizer(texts, files.data.tokenizer.vocab_size, tmp_path / "gpu.model")
    section = README.read_text().split("## Your own data", 1)[1]
    assert re.search(r"# GPU-sized \(a CUDA GPU", section), "the GPU-sized example must say it needs a GPU"


@pytest.mark.e2e
@pytest.mark.slow
def test_testing_page_has_the_collected_test_counts(request):
    """docs/testing.md's table of tests per tier is what a fresh collection counts: this run's own when it
    collected the whole suite (as `make test` does), else tests/count_tests.py's (one subprocess that only
    collects: about 20 s on 2 cores)."""
    from count_tests import SUITE_COUNTS, table

    if SUITE_COUNTS in request.config.stash:
        block = table(request.config.stash[SUITE_COUNTS])
    else:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "count_tests.py")], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        block = proc.stdout.strip()
    assert block.startswith("<!--") and "| all |" in block, block
    assert block in (DOCS / "testing.md").read_text(), (
        "docs/testing.md's test counts differ from pytest's collection; rerun "
        f"`.venv/bin/python tests/count_tests.py --write`. Collected now:\n{block}")


@pytest.mark.unit
def test_readme_figures_agree_with_the_configs_and_the_pages_that_measured_them():
    """The pinned torch and Python, the First hour's lr schedule figures, and every result the README quotes
    from a docs page (compute multipliers, the AdamW run's final loss) are where they come from."""
    from kimi.optim.schedules import lr_multiplier

    text = " ".join(README.read_text().split())
    torch_pin = re.search(r"\(torch (\S+) pinned\)", text)
    assert torch_pin and f"TORCH_SPEC ?= torch=={torch_pin[1]}\n" in (ROOT / "Makefile").read_text()
    python = re.search(r"Python >= (\d+\.\d+)", text)
    assert python and f'requires-python = ">={python[1]}"' in (ROOT / "pyproject.toml").read_text()
    # First hour, Extend: 600 -> 1200 steps under the default cosine
    extend = re.search(r"from its final ([\d.]+) x peak back up to ([\d.]+) x peak at step (\d+)", text)
    optim = _summary().cfg.optim
    assert extend and float(extend[1]) == optim.min_lr_ratio, extend
    assert f"{lr_multiplier(int(extend[3]), optim, 2 * int(extend[3])):.2f}" == extend[2]
    assert f"the last {round(optim.decay_fraction * 100)}% of steps" in text
    # quoted results: each figure is on the page its sentence links
    results = " ".join((DOCS / "README.md").read_text().split()).split("## Results", 1)[1]  # the docs' index
    quoted = re.findall(r"\[docs/(\w+\.md)[^\]]*\]\([^)]*\): (.*?)(?= - \[|$)", results)
    adamw = re.search(r"With `optim=adamw` the same run ends at validation loss ([\d.]+) \(see \[[^\]]*\]\("
                      r"docs/(\w+\.md)", text)
    assert adamw and len(quoted) >= 5
    missing = [f"{adamw[1]} (docs/{adamw[2]})"] if adamw[1] not in (DOCS / adamw[2]).read_text() else []
    for page, sentence in quoted:
        body = (DOCS / page).read_text()
        missing += [f"{x} (docs/{page})" for x in re.findall(r"\d+\.\d+x", sentence) if x not in body]
    assert not missing, f"README.md and docs/README.md quote figures their pages do not have: {missing}"


def _as_written(value) -> str:
    """A config value as the README's key table writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


@pytest.mark.unit
def test_readme_key_table_defaults_are_the_configs():
    """Each default in the key tables (README.md's Configuration, docs/configuration.md) is what the default
    config composes to (rows whose default is a preset's, such as `2 (tiny)`, are checked for that preset)."""
    from kimi.summary import compose_config

    cfg = compose_config([])  # as composed: model.vocab_size still null
    row = r"^\| `([\w.]+)`((?:(?:, | / )`[\w.]+`)*) \| ([^|]*) \|"
    pages = (README, DOCS / "configuration.md")
    rows = [r for page in pages for r in re.findall(row, page.read_text(), flags=re.M)]
    checked, wrong = 0, []
    for first, more, defaults in rows:
        prefix = first.rsplit(".", 1)[0]
        keys = [first] + [k if not k.startswith(".") else prefix + k for k in re.findall(r"`([\w.]+)`", more)]
        values = [v.strip().strip("`") for v in re.split(r",| / ", defaults)]
        if len(values) == 1 and len(keys) > 1:
            values *= len(keys)  # one default for all (`parallel.dp_shard`, `.dp_replicate`, `.tp` | 1)
        if len(values) != len(keys) or not defaults.strip():
            continue
        for key, said in zip(keys, values):
            said = said.split(" (")[0]
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            if dataclasses.is_dataclass(node):
                continue  # a group (`trainer`, ...), not a key
            actual = _as_written(node)
            same = actual == said or (isinstance(node, (int, float)) and not isinstance(node, bool)
                                      and re.fullmatch(r"[\d.e+-]+", said) and float(said) == float(node))
            checked += 1
            if not same:
                wrong.append(f"{key}: README {said}, config {actual}")
    assert checked >= 40, f"only {checked} defaults found in the key tables"
    assert not wrong, "the key tables give defaults the config does not have:\n" + "\n".join(wrong)
