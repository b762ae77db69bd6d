"""DVC: `dvc repro` of the data stages and a push/pull round trip."""

from __future__ import annotations

import shutil

import yaml
from conftest import REPO, copy_repo, run

from distrepro.data.convert import verify_dir


def out_hashes(lock_text: str) -> dict[str, str]:
    lock = yaml.safe_load(lock_text)
    return {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", [])}


def test_dvc_repro_reproduces_the_committed_hashes_and_round_trips(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    run(["dvc", "repro"], repo)
    assert "up to date" in run(["dvc", "status"], repo).stdout
    produced = out_hashes((repo / "dvc.lock").read_text())
    assert produced["data/tfrecords/digits"].endswith(".dir")
    assert produced == out_hashes((REPO / "dvc.lock").read_text())

    remote = tmp_path / "remote"
    run(["dvc", "remote", "add", "-d", "local", str(remote)], repo)
    run(["dvc", "push"], repo)
    assert any(remote.rglob("*")), "dvc push sent nothing"
    shutil.rmtree(repo / "data" / "tfrecords" / "digits")
    shutil.rmtree(repo / ".dvc" / "cache")
    run(["dvc", "pull"], repo)
    assert verify_dir(repo / "data" / "tfrecords" / "digits")["validation"] == 360
    assert "up to date" in run(["dvc", "status"], repo).stdout
