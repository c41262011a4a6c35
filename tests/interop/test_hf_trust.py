"""Model folders are trust boundaries (docs/huggingface.md, "What a model folder may do"): a folder's Python
code runs only with trust_remote_code=true (and, when it is not the code to-hf recorded, with
trust_modified_code=true as well); file names read from a folder's files stay inside it; to-hf's output is
complete or absent; and each refusal is one line with the exit code kimi/errors.py documents."""

import dataclasses
import errno
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_corpus, tiny_model_cfg

pytestmark = pytest.mark.unit

# Imported by transformers' dynamic-module loader, it leaves evidence that the folder's code ran.
PLANTED = "import pathlib; pathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir of random tiny weights (a weights-only checkpoint, as from-hf writes) and a sentencepiece
    tokenizer: a run to export in a second, without training one."""
    from kimi import checkpoint
    from kimi.data.tokenizer import train_tokenizer
    from kimi.model import KimiModel

    root = tmp_path_factory.mktemp("trust")
    corpus = make_corpus(root / "corpus", docs=3)
    tokenizer = train_tokenizer([p.read_text() for p in sorted(corpus.glob("*.txt"))], 300,
                                root / "spm" / "tokenizer.model")
    cfg = tiny_model_cfg(vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = KimiModel(cfg).eval()
    checkpoint.save_weights(root / "run" / "init", model.state_dict(), {"model": dataclasses.asdict(cfg)}, {})
    tokenizer.copy_to(root / "run" / "tokenizer.model")
    return root / "run"


@pytest.fixture(scope="module")
def export(run):
    """The run's to-hf export with its own modeling code."""
    from kimi.convert import main

    assert main(["to-hf", f"run={run}", f"out={run.parent / 'hf'}"]) == 0
    return run.parent / "hf"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def planted(export: Path, where: Path, keep_record: bool = True) -> tuple[Path, Path]:
    """A copy of the export whose modeling_kimi.py writes a marker file when imported: (folder, marker)."""
    # transformers caches a folder's modules under the folder's name: one name per planted folder
    folder, marker = where / f"planted_{where.name}", where / "code-ran"
    shutil.copytree(export, folder)
    modeling = folder / "modeling_kimi.py"
    modeling.write_text(PLANTED.format(marker=str(marker)) + modeling.read_text())
    if not keep_record:
        (folder / "kimi_code.json").unlink()
    return folder, marker


# ---- code runs only when asked ---------------------------------------------------------------------------

def test_the_export_records_its_code(export):
    from kimi.interop.trust import allow_code, code_files

    record = json.loads((export / "kimi_code.json").read_text())
    config = json.loads((export / "config.json").read_text())
    assert record["sha256"] == code_files(export) and "modeling_kimi.py" in record["sha256"]
    assert record["auto_map"] == config["auto_map"]
    assert allow_code(export, config, trust_remote_code=True) is True


def test_eval_refuses_a_folders_code_without_the_keys(run, export, tmp_path, capsys):
    """hf= with code: refused without trust_remote_code=true (our own export too); planted code refused
    even with it, unless trust_modified_code=true; nothing imported, exit 2, one line."""
    from kimi.eval.cli import main

    folder, marker = planted(export, tmp_path)
    base = [f"run={run}", "limit=1"]
    assert main([*base, f"hf={export}"]) == 2
    assert "trust_remote_code=true" in one_line_error(capsys)
    assert main([*base, f"hf={folder}"]) == 2
    assert "holds its own Python code" in one_line_error(capsys)
    assert main([*base, f"hf={folder}", "trust_remote_code=true"]) == 2
    line = one_line_error(capsys)
    assert "modeling_kimi.py edited" in line and "trust_modified_code=true" in line
    (folder / "extra.py").write_text(PLANTED.format(marker=str(marker)))
    assert main([*base, f"hf={folder}", "trust_remote_code=true"]) == 2
    assert "extra.py added" in one_line_error(capsys)
    assert main(["run=x", "trust_remote_code=true"]) == 2  # a key that would do nothing
    assert "give hf=DIR" in capsys.readouterr().err
    assert not marker.exists()


def test_the_keys_let_the_code_run(run, export, tmp_path):
    """Planted code runs with both keys; another tool's export (auto_map, no record of ours) with
    trust_remote_code alone."""
    from kimi.eval.hf import hf_lm
    from kimi.generate import load_from_checkpoint

    _, tokenizer, _ = load_from_checkpoint(str(run))
    folder, marker = planted(export, tmp_path / "ours")
    hf_lm(str(folder), tokenizer, 1, 32, "cpu", trust_remote_code=True, trust_modified_code=True)
    assert marker.read_text() == "ran"
    folder, marker = planted(export, tmp_path / "theirs", keep_record=False)
    hf_lm(str(folder), tokenizer, 1, 32, "cpu", trust_remote_code=True)
    assert marker.read_text() == "ran"


def test_our_export_scores_and_decodes_with_the_key(run, export):
    """lm-eval's hf model on our export, with trust_remote_code: the log-likelihood ours gives, and its
    model's greedy decoding our tokens (random weights: the text may be bytes of no character)."""
    from lm_eval.api.instance import Instance

    from kimi.eval.hf import hf_lm
    from kimi.eval.lm import KimiLM
    from kimi.generate import load_from_checkpoint
    from kimi.model.decode import generate

    model, tokenizer, _ = load_from_checkpoint(str(run))
    ours = KimiLM(model, tokenizer, batch_size=1, max_length=32)
    theirs = hf_lm(str(export), tokenizer, 1, 32, "cpu", trust_remote_code=True)
    pairs = [Instance("loglikelihood", {}, ("The king loves", " the crown."), 0)]
    (lp, greedy), = ours.loglikelihood(pairs)
    (ref_lp, ref_greedy), = theirs.loglikelihood(pairs)
    assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
    prompt = tokenizer.encode("My lord")
    decoded = theirs.model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0]
    decoded = decoded[len(prompt):]
    mine = generate(model, prompt, 4, temperature=0, eos_id=tokenizer.eos_id)
    assert decoded.tolist()[:len(mine)] == mine and len(mine) > 0


def test_from_hf_and_load_hf_never_import_the_folder(export, tmp_path, capsys):
    """Reading the weights runs nothing of the folder's: no key needed, the planted code never imported."""
    from kimi.convert import load_hf, main

    folder, marker = planted(export, tmp_path)
    assert main(["from-hf", f"hf={folder}", f"run={tmp_path / 'run'}"]) == 0
    load_hf(folder)
    assert not marker.exists()


# ---- names stay inside their folder -----------------------------------------------------------------------

def _escape_by_index(folder: Path, outside: Path, how: str) -> str:
    """Move the weights out of `folder` and name them from an index, as `how` does; returns the entry."""
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")
    entry = {"dotdot": f"../{outside.name}/model.safetensors", "absolute": str(outside / "model.safetensors"),
             "link": "model-00001-of-00001.safetensors"}[how]
    if how == "link":
        (folder / entry).symlink_to(outside / "model.safetensors")
    from safetensors import safe_open

    with safe_open(outside / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    index = {"weight_map": dict.fromkeys(names, entry)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return entry


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link", "default_name_linked"])
def test_from_hf_refuses_weights_outside_the_folder(export, tmp_path, capsys, how):
    from kimi.convert import main

    folder, outside = tmp_path / "hf", tmp_path / "elsewhere"
    shutil.copytree(export, folder)
    outside.mkdir()
    if how == "default_name_linked":  # no index: model.safetensors itself a link out of the folder
        shutil.move(folder / "model.safetensors", outside / "model.safetensors")
        (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
        words = [f"{folder / 'model.safetensors'} leads out of {folder}"]
    else:
        entry = _escape_by_index(folder, outside, how)
        words = [f"{folder / 'model.safetensors.index.json'} names {entry!r}", f"not a file inside {folder}"]
    capsys.readouterr()
    assert main(["from-hf", f"hf={folder}", f"run={tmp_path / 'run'}"]) == 2
    line = one_line_error(capsys)
    assert all(w in line for w in words), line
    assert not (tmp_path / "run").exists()


def test_eval_refuses_weights_outside_the_folder(run, export, tmp_path, capsys):
    """transformers would read what the index names: hf= is refused first, one line, exit 2."""
    from kimi.eval.cli import main

    folder, outside = tmp_path / "hf", tmp_path / "elsewhere"
    shutil.copytree(export, folder)
    outside.mkdir()
    entry = _escape_by_index(folder, outside, "absolute")
    assert main([f"run={run}", f"hf={folder}", "trust_remote_code=true", "limit=1"]) == 2
    assert f"names {entry!r}, which is not a file inside" in one_line_error(capsys)


def test_a_prepared_data_manifest_cannot_name_files_elsewhere(tmp_path):
    from kimi.errors import DataError
    from kimi.data.pack import MANIFEST, _prepared

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 8)
    split = {"shards": [{"file": "../secret.bin", "sha256": "0" * 64}]}
    (data_dir / MANIFEST).write_text(json.dumps({"splits": {"train": split, "val": split}}))
    with pytest.raises(DataError, match=r"manifest.json names '../secret.bin', which is not a file inside"):
        _prepared(data_dir)


def test_a_checkpoint_file_linked_elsewhere_is_refused(run, tmp_path, capsys):
    """A checkpoint whose data file is a link out of it (its manifest's size and checksum still right):
    generate and to-hf both refuse it, exit 1."""
    from kimi.convert import main as convert
    from kimi.generate import main as generate

    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "init", ckpt)
    data = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    shutil.move(data, tmp_path / data.name)
    data.symlink_to(tmp_path / data.name)
    assert generate([f"run={ckpt}", "max_new_tokens=2"]) == 1
    assert "not a file inside it" in one_line_error(capsys)
    assert convert(["to-hf", f"run={ckpt}", f"out={tmp_path / 'hf'}"]) == 1
    assert "not a file inside it" in one_line_error(capsys)
    assert not (tmp_path / "hf").exists()


# ---- exports complete or absent --------------------------------------------------------------------------

def listing(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_to_hf_replaces_an_export_only_when_asked(run, tmp_path, capsys):
    """A sharded export, then an unsharded one over it: refused without overwrite=true (the old one kept),
    with it the folder holds exactly the new export, which from-hf reads."""
    from kimi.convert import main

    out = tmp_path / "hf"
    assert main(["to-hf", f"run={run}", f"out={out}", "shard_gb=0.00002"]) == 0
    first = listing(out)
    assert "model.safetensors.index.json" in first and sum(name.startswith("model-") for name in first) > 1
    capsys.readouterr()
    assert main(["to-hf", f"run={run}", f"out={out}"]) == 2
    assert "already holds files" in one_line_error(capsys) and listing(out) == first
    assert main(["to-hf", f"run={run}", f"out={out}", "overwrite=true"]) == 0
    second = listing(out)
    assert "model.safetensors" in second and not any(name.startswith("model-") for name in second)
    assert "model.safetensors.index.json" not in second
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing left beside it
    assert main(["from-hf", f"hf={out}", f"run={tmp_path / 'back'}"]) == 0


def test_to_hf_refuses_a_file_and_what_overwrite_must_not_delete(run, tmp_path, capsys):
    """A file (or a path under one), the run being exported, a folder that is no export: each one line,
    exit 2, nothing changed, even with overwrite=true."""
    from kimi.convert import main

    (tmp_path / "file").write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    before = sorted(p.name for p in run.rglob("*"))
    cases = [(tmp_path / "file", [], "is a file, not a folder"),
             (tmp_path / "file" / "hf", [], "file is a file, not a folder"),
             (run, ["overwrite=true"], "holds the checkpoint being exported"),
             (tmp_path / "notes", ["overwrite=true"], "holds files but no config.json")]
    for out, extra, words in cases:
        assert main(["to-hf", f"run={run}", f"out={out}", *extra]) == 2
        assert words in one_line_error(capsys)
    assert (tmp_path / "file").read_text() == (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    assert sorted(p.name for p in run.rglob("*")) == before


def _full_disk(*args, **kwargs):
    Path(args[1]).write_bytes(b"part of a shard")  # a write cut short
    raise OSError(errno.ENOSPC, "No space left on device")


class SafetensorError(Exception):
    """What safetensors raises for a failed write: its own type, the OS error only in its text."""


def _full_disk_as_safetensors_says(*args, **kwargs):
    Path(args[1]).write_bytes(b"part of a shard")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("write", [_full_disk, _full_disk_as_safetensors_says])
def test_a_full_disk_leaves_no_partial_export_and_keeps_the_old_one(run, export, tmp_path, capsys,
                                                                   monkeypatch, write):
    from kimi.convert import main

    out = tmp_path / "hf"
    shutil.copytree(export, out)
    before = listing(out)
    monkeypatch.setattr("safetensors.torch.save_file", write)
    capsys.readouterr()
    assert main(["to-hf", f"run={run}", f"out={out}", "overwrite=true"]) == 1
    line = one_line_error(capsys)
    assert "no space left on device" in line and "the previous export is kept" in line, line
    assert listing(out) == before and [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert main(["to-hf", f"run={run}", f"out={tmp_path / 'new'}"]) == 1
    assert "no export was written" in one_line_error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


# ---- tokenizer files and exit codes ---------------------------------------------------------------------

@pytest.mark.parametrize("content,words", [
    (None, "tokenizer.json not copied: it is a directory"),
    (b"\x00\x01 garbage", "tokenizer.json is not a tokenizer.json: it is not valid JSON"),
    (b'{"version": "1.0"}', "tokenizer.json is not a tokenizer.json: it is JSON, but not the tokenizers"),
])
def test_from_hf_says_what_is_wrong_with_a_tokenizer_json(export, tmp_path, capsys, content, words):
    from kimi.convert import main

    folder = tmp_path / "hf"
    shutil.copytree(export, folder)
    (folder / "tokenizer.model").unlink()
    (folder / "tokenizer.json").unlink()
    if content is None:
        (folder / "tokenizer.json").mkdir()
    else:
        (folder / "tokenizer.json").write_bytes(content)
    assert main(["from-hf", f"hf={folder}", f"run={tmp_path / 'run'}"]) == 0
    assert words in capsys.readouterr().out


def test_a_forged_checkpoint_exits_1_in_to_hf_as_in_generate(run, tmp_path, capsys):
    from kimi import checkpoint
    from kimi.convert import main as convert
    from kimi.generate import main as generate

    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "init", ckpt)
    payload = pickle.dumps(print)  # a reference to a function: never in checkpoint metadata
    (ckpt / ".metadata").write_bytes(payload)
    marker = json.loads((ckpt / checkpoint.COMPLETE).read_text())
    marker["files"][".metadata"] = [len(payload), checkpoint.manifest.crc32(ckpt / ".metadata")]
    (ckpt / checkpoint.COMPLETE).write_text(json.dumps(marker))
    assert generate([f"run={ckpt}", "max_new_tokens=2"]) == 1
    expected = one_line_error(capsys)
    assert convert(["to-hf", f"run={ckpt}", f"out={tmp_path / 'hf'}"]) == 1
    assert one_line_error(capsys) == expected and "refusing to load checkpoint" in expected
    assert not (tmp_path / "hf").exists()
