"""Device placement: one GPU per Horovod rank, gpus_per_worker per
parameter-server worker, none for ps tasks and the coordinator; refusals."""

from __future__ import annotations

import os

import pytest
from test_setup import V100, stand_in

from distrepro.config import compose_config, memory_mb
from distrepro.devices import assign_gpus, devices_of_tasks, host_gpus
from distrepro.launch import ConfigError, validate
from distrepro.processes import process_env

EIGHT = [str(i) for i in range(8)]


def test_eight_gpus_eight_workers_one_each():
    assert assign_gpus(8, 1, EIGHT) == EIGHT


def test_two_gpus_per_worker_are_consecutive():
    assert assign_gpus(3, 2, EIGHT) == ["0,1", "2,3", "4,5"]


def test_no_gpus_asked_for_none_given():
    assert assign_gpus(4, 0, EIGHT) == ["", "", "", ""]


def test_more_gpus_than_the_machine_has_is_refused_naming_the_keys():
    with pytest.raises(ValueError) as error:
        assign_gpus(8, 2, EIGHT)
    message = str(error.value)
    assert "strategy.num_workers=8" in message and "strategy.gpus_per_worker=2" in message
    assert "needs 16 GPUs" in message and "has 8" in message


def test_parameter_server_tasks_get_their_gpus_and_the_rest_none():
    placed = {"worker:0": "127.0.0.1", "worker:1": "127.0.0.1", "ps:0": "127.0.0.1"}
    devices = devices_of_tasks(placed, 2, ["0", "1", "2", "3"])
    assert {task: env["CUDA_VISIBLE_DEVICES"] for task, env in devices.items()} == {
        "worker:0": "0,1",
        "worker:1": "2,3",
        "ps:0": "",
        "coordinator": "",
    }
    assert devices_of_tasks(placed, 1, []) == {}  # no GPU: nothing changes


def test_parameter_server_workers_number_their_gpus_on_their_own_host():
    placed = {"worker:0": "node1", "worker:1": "node2", "worker:2": "node2", "ps:0": "node1"}
    devices = devices_of_tasks(placed, 1, ["0", "1"])
    assert [devices[f"worker:{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0", "0", "1"]


def test_host_gpus_from_a_schedulers_grant_or_nvidia_smi(tmp_path):
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    stand_in(tmp_path / "nvidia-smi", f"{V100}\n{V100.replace('GPU 0', 'GPU 1')}")
    assert host_gpus({"PATH": str(tmp_path)}) == ["0", "1"]
    assert host_gpus({"PATH": str(tmp_path / "nothing")}) == []


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """This machine, as the launcher sees it, with two GPUs."""
    stand_in(tmp_path / "bin" / "nvidia-smi", f"{V100}\n{V100.replace('GPU 0', 'GPU 1')}")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.num_workers=4", "strategy.gpus_per_worker=1"], "needs 4 GPUs, but this"),
        (["strategy=parameter_server", "strategy.gpus_per_worker=2"], "needs 4 GPUs, but this"),
        (["strategy.gpus_per_worker=2"], "Horovod uses one GPU per rank"),
        (["precision=mixed_fp16", "precision.loss_scale=big"], "precision.loss_scale='big'"),
        (["precision=mixed_fp16", "precision.loss_scale=0"], "precision.loss_scale='0'"),
    ],
)
def test_impossible_device_and_loss_scale_configs_are_refused(
    digits_tfrecords, two_gpus, overrides, message
):
    cfg = compose_config([f"data.tfrecord_dir={digits_tfrecords}", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_gpus_that_fit_pass_and_unasked_gpus_are_hidden(digits_tfrecords, two_gpus):
    validate(
        compose_config([f"data.tfrecord_dir={digits_tfrecords}", "strategy.gpus_per_worker=1"])
    )
    assert process_env(compose_config([]))["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in process_env(compose_config(["strategy.gpus_per_worker=1"]))


def test_xla_and_mpi_reach_every_process_environment():
    env = process_env(compose_config(["train.xla=true", "strategy.controller=mpi"]))
    assert "--tf_xla_auto_jit=2" in env["TF_XLA_FLAGS"]
    assert (env.get("OMPI_ALLOW_RUN_AS_ROOT") == "1") == (os.geteuid() == 0)
    assert "TF_XLA_FLAGS" not in process_env(compose_config([]))


def test_horovods_tuning_reaches_its_ranks_as_horovods_own_variables(tmp_path):
    from distrepro.strategies.horovod import tuning_env

    tuned = compose_config(
        ["strategy.fusion_threshold_mb=32", "strategy.cycle_time_ms=2.5", "strategy.autotune=true"]
    )
    assert tuning_env(tuned, tmp_path) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 2**20),
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "horovod_autotune.csv"),
    }
    assert tuning_env(compose_config([]), tmp_path) == {}  # Horovod's own defaults


def test_a_runs_memory_is_estimated_from_its_processes_data_and_model():
    def memory(*overrides):
        return memory_mb(compose_config(list(overrides)))

    # 2 ranks x 1.5 GB, and 64 digits of 32 px through widths 16 x 6 blocks: 24 MB
    assert memory() == 2 * 1500 + 24
    assert memory("strategy=parameter_server") == 4 * 1500 + 24  # + ps and coordinator
    assert memory("train.global_batch_size=128") == 2 * 1500 + 48
    # ResNet-50 at 224 px on CPU (8 ranks): about 205 MB (196 MiB) an image;
    # on GPUs the host keeps only input batches
    cpu = memory("experiment=aws_blog_8gpu", "strategy.gpus_per_worker=0")
    assert 2048 * 190 < cpu - 8 * 1500 < 2048 * 200
    assert memory("experiment=aws_blog_8gpu") < cpu / 20
