"""Fixtures: fake ILSVRC2012 trees in each accepted form, made on the fly."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SYNSETS = ["n01440764", "n01443537", "n01484850"]
TEXTS = {
    "n01440764": "tench, Tinca tinca",
    "n01443537": "goldfish",
    "n01484850": "great white shark",
}
PER_CLASS = 4


def photo(seed: int, size=(48, 36), mode="RGB") -> Image.Image:
    """A smooth, photo-like image (gradients + noise), not a flat colour."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    channels = [
        (np.sin(xx / (3 + c + seed % 5)) + np.cos(yy / (4 + c))) * 60 + 128 for c in range(3)
    ]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 10, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)


def jpeg_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def train_images() -> dict[str, dict[str, bytes]]:
    """synset -> {file name -> bytes}, with ImageNet's odd files in the first class."""
    images = {}
    for c, synset in enumerate(SYNSETS):
        files = {f"{synset}_{i}.JPEG": jpeg_bytes(photo(10 * c + i)) for i in range(PER_CLASS)}
        images[synset] = files
    odd = images[SYNSETS[0]]
    odd[f"{SYNSETS[0]}_cmyk.JPEG"] = jpeg_bytes(photo(91, mode="CMYK"))
    odd[f"{SYNSETS[0]}_gray.JPEG"] = jpeg_bytes(photo(92, mode="L"))
    png = io.BytesIO()
    photo(93).save(png, "PNG")
    odd[f"{SYNSETS[0]}_png.JPEG"] = png.getvalue()
    return images


def val_images() -> list[tuple[str, str, bytes]]:
    """(file name, synset, bytes), names in ILSVRC2012_val_NNNNNNNN order."""
    return [
        (f"ILSVRC2012_val_{i + 1:08d}.JPEG", SYNSETS[i % len(SYNSETS)], jpeg_bytes(photo(500 + i)))
        for i in range(6)
    ]


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)


def write_train_tar(path: Path, train: dict[str, dict[str, bytes]]) -> None:
    """ILSVRC2012_img_train.tar's form: a tar of one tar per synset."""
    with tarfile.open(path, "w") as outer:
        for synset, files in train.items():
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for name, data in files.items():
                    add_bytes(tar, name, data)
            add_bytes(outer, f"{synset}.tar", inner.getvalue())


def make_raw(root: Path, train_form: str, val_form: str) -> Path:
    """train_form: tar|tree; val_form: sorted|kaggle_tar|lines_flat."""
    root.mkdir(parents=True)
    train = train_images()
    if train_form == "tar":
        write_train_tar(root / "ILSVRC2012_img_train.tar", train)
    else:
        for synset, files in train.items():
            write_tree(root / "train" / synset, files)
    val = val_images()
    if val_form == "sorted":
        for name, synset, data in val:
            write_tree(root / "val" / synset, {name: data})
    elif val_form == "kaggle_tar":
        with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as tar:
            for name, _, data in val:
                add_bytes(tar, name, data)
        rows = "".join(f"{Path(n).stem},{s} 1 2 3 4\n" for n, s, _ in reversed(val))
        (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + rows)
    else:
        write_tree(root / "val", {name: data for name, _, data in val})
        labels = "".join(f"{s}\n" for _, s, _ in val)
        (root / "imagenet_2012_validation_synset_labels.txt").write_text(labels)
    mapping = "".join(f"{s} {t}\n" for s, t in TEXTS.items())
    (root / "LOC_synset_mapping.txt").write_text(mapping)
    return root


@pytest.fixture
def raw_factory(tmp_path):
    def factory(train_form="tree", val_form="sorted", name="raw"):
        return make_raw(tmp_path / name, train_form, val_form)

    return factory


REPO = Path(__file__).resolve().parents[1]

# The tests prove launches, restarts, tracking, hosts and links, not the
# model: a ResNet of one block per stage traces in half the time of the
# embedded default's two and sends 45 % of its bytes. The outage-at-start run
# and elastic Horovod's keep the default for their longer epochs.
SHALLOW = "model.blocks_per_stage=[1,1,1]"


def copy_repo(dest: Path) -> Path:
    """The committed-or-tracked files of this repository, as a fresh git repo."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def project_env(cwd: Path) -> dict[str, str]:
    """The environment of a project command in cwd: the venv first on PATH,
    cwd's own package first on the import path, cwd's own MLflow store."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    if (cwd / "src").is_dir():
        env["PYTHONPATH"] = str(cwd / "src")
    return env


def wait_for_http(url: str, seconds: float = 120) -> None:
    """Until url answers (a server the test started on 127.0.0.1)."""
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {seconds:.0f} s")


def run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a project command (project_env); fail with its output."""
    result = subprocess.run(
        cmd, cwd=cwd, env=project_env(cwd), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="session")
def digits_tfrecords(tmp_path_factory) -> Path:
    """The embedded digits, prepared once for the session's training tests."""
    from distrepro.config import compose_config
    from distrepro.digits import write_digits
    from distrepro.prepare import prepare

    root = tmp_path_factory.mktemp("digits")
    cfg = compose_config(
        [f"data.raw_dir={root / 'raw'}", f"data.tfrecord_dir={root / 'tfrecords'}"]
    )
    write_digits(root / "raw", cfg.data.image_size, cfg.data.val_fraction, cfg.seed)
    prepare(cfg)
    return root / "tfrecords"


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory) -> Path:
    """An MLflow sqlite store with its tables made, once: each test gets a copy
    instead of a run creating its tables (seconds each)."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch, empty_mlflow_store) -> str:
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


# Inherited by every process the tests start, so that they are told apart from
# training processes of other runs on the same machine: this session's pid and
# start time (a pid alone may be a later process's).
SESSION_MARK = "DISTREPRO_TEST_SESSION"


def process_mark(pid: int) -> str:
    import psutil

    return f"{pid}:{psutil.Process(pid).create_time()!r}"


# `pytest` runs the suite in three processes (pytest-xdist, pyproject.toml):
# each is a session of its own, whose tests count and stop only what it started.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ[SESSION_MARK] = process_mark(os.getpid())
TEST_SESSION = os.environ.setdefault(SESSION_MARK, process_mark(os.getpid()))
HOSTS_SH = str(REPO / "scripts" / "hosts.sh")
SLURM_SH = str(REPO / "tests" / "slurm.sh")


def alive(mark: str) -> bool:
    """Whether the session of a mark runs; a mark of another form is left alone."""
    import psutil

    pid, _, started = mark.partition(":")
    if not (pid.isdigit() and started):
        return True
    try:
        return process_mark(int(pid)) == mark
    except psutil.Error:
        return False


def reap_dead_sessions() -> None:
    """What a test session killed with SIGKILL left, removed at the next
    one's start: the hosts and clusters it owned (`hosts.sh down --stale`:
    their daemons and clients run on them), then every process that carries
    its mark."""
    import psutil

    if os.geteuid() == 0 and shutil.which("ip"):
        subprocess.run([HOSTS_SH, "down", "--stale"], check=True)
    left = []
    for proc in psutil.process_iter():
        try:
            mark = proc.environ().get(SESSION_MARK)
        except psutil.Error:
            continue
        if mark and mark != TEST_SESSION and not alive(mark):
            left.append(proc)
            proc.kill()
    psutil.wait_procs(left, timeout=10)


def interrupt(signum, frame):
    raise KeyboardInterrupt


def interrupt_workers(signum, frame):
    """pytest-xdist's controller: the SIGTERM goes to its workers, which hold
    the fixtures (they ignore SIGINT) and end the run once torn down."""
    import psutil

    for worker in psutil.Process().children():
        worker.send_signal(signal.SIGTERM)


def pytest_sessionstart(session) -> None:
    reap_dead_sessions()
    # SIGTERM (CI's time limit, a scheduler) unwinds like Ctrl-C: pytest then
    # tears down every fixture, clusters and hosts included.
    controller = session.config.getoption("numprocesses", 0) and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    )
    signal.signal(signal.SIGTERM, interrupt_workers if controller else interrupt)


def netns_names() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines()]


def skip_without_hosts() -> None:
    if os.geteuid() != 0:
        pytest.skip("hosts need root: network namespaces (ip netns) and an sshd in each")
    missing = [tool for tool in ("ip", "ssh", "sshd", "unshare") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"hosts need {', '.join(missing)}: `make test` installs them")


@pytest.fixture(scope="session")
def two_hosts(tmp_path_factory) -> Path:
    """node1 and node2 (scripts/hosts.sh), removed afterwards with every
    process left on them."""
    skip_without_hosts()
    folder = tmp_path_factory.mktemp("hosts")
    subprocess.run([HOSTS_SH, "up", folder], check=True)
    try:
        yield folder
    finally:
        subprocess.run([HOSTS_SH, "down", folder], check=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Path:
    """A SLURM cluster of two namespace hosts, node1 and node2, with no sshd
    (tests/slurm.sh); its folder. Every daemon it started has ended afterwards."""
    import psutil

    skip_without_hosts()
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "findmnt")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        pytest.skip(f"a SLURM cluster needs {', '.join(missing)}: `make test` installs them")
    folder = tmp_path_factory.mktemp("slurm")
    up = subprocess.run([SLURM_SH, "up", folder], capture_output=True, text=True)
    daemons, hosts = [], []
    try:
        assert up.returncode == 0, up.stderr
        daemons = [int(p.read_text()) for p in folder.glob("*.pid")]
        hosts = (folder / "hosts" / "namespaces").read_text().split()
        yield folder
    finally:
        subprocess.run([SLURM_SH, "down", folder], check=True)
    assert not [pid for pid in daemons if psutil.pid_exists(pid)], "a daemon outlived the tests"
    assert not set(hosts) & set(netns_names()), "a host outlived the tests"


HOSTS_REGISTRY = Path("/run/distrepro-hosts")  # scripts/hosts.sh's

# Tests of one cluster, started once, in one process of the suite (a pytest-xdist group).
ON_TWO_HOSTS = pytest.mark.xdist_group("two_hosts")


# pytest-xdist's groups in the order it hands them out: the three longest
# (about 14, 13 and 8 minutes in a CI run of three processes) start at once. A
# process whose group has two tests or fewer (the network grid's) is given the
# next group at once too: a short one, so that the conditions' (10 minutes)
# go to the first process free rather than wait behind the grid.
GROUPS_IN_ORDER = ("reproduced", "network_grid", "slurm", "two_hosts", "conditions", "outage")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The groups first (GROUPS_IN_ORDER), then the other tests that train, so that
    the quick ones fill the processes' last minutes (pytest-xdist hands them
    out in this order: `--no-loadscope-reorder`). Stop at once if
    pytest-xdist groups nothing (its 3.8 with pytest 9.2, pytest-xdist#1386):
    each group's fixtures would run in every process."""
    items.sort(key=start_rank)
    if getattr(config.option, "loadgroup", False):
        lost = [
            i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
        ]
        if lost:
            raise pytest.UsageError(f"pytest-xdist left {lost[0]} out of its group")


def start_rank(item) -> int:
    group = item.get_closest_marker("xdist_group")
    if group and group.args[0] in GROUPS_IN_ORDER:
        return GROUPS_IN_ORDER.index(group.args[0])
    trains = "digits_tfrecords" in item.fixturenames or item.get_closest_marker("slow")
    return len(GROUPS_IN_ORDER) + (0 if trains else 1)


def started_ticks(pid: str) -> str:
    """A process's start time as /proc/PID/stat gives it (hosts.sh's `started`), "" if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except OSError:
        return ""


def hosts_left_behind() -> set[str]:
    """Namespaces and CPU groups of hosts that no live owner holds: what a
    process that ended failed to remove. Hosts that the suite's other processes
    hold meanwhile are not counted."""
    held = set()
    for link in HOSTS_REGISTRY.glob("*"):
        try:
            pid, ticks = (link / "owner").read_text().split()
            names = (link / "namespaces").read_text().split()
        except (OSError, ValueError):
            continue  # being made or removed right now: its owner is at work
        if started_ticks(pid) == ticks:
            held.update(names)
    groups = {group.name for group in Path("/sys/fs/cgroup/cpu").glob("drp*")}
    return ({name for name in netns_names() if name.startswith("drp")} | groups) - held


def assert_no_hosts_left_behind(seconds: float = 60) -> None:
    """None left behind, or not for long: a test that leaves hosts on purpose
    (a killed owner's) has them removed within seconds."""
    deadline = time.monotonic() + seconds
    while left := hosts_left_behind():
        assert time.monotonic() < deadline, f"hosts left behind: {sorted(left)}"
        time.sleep(1)


@contextlib.contextmanager
def stale_hosts_kept():
    """While a test looks at the hosts it left on purpose, no `hosts.sh down
    --stale` (a network run's start, a session's) removes them."""
    HOSTS_REGISTRY.mkdir(exist_ok=True)
    with open(HOSTS_REGISTRY / ".stale.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file unlocks it


def training_processes() -> list:
    """Training processes of this package that this test session started, still alive."""
    import psutil

    from distrepro.strategies import REGISTRY

    names = tuple(REGISTRY.values())
    alive = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(name in cmdline for name in names):
            try:
                if proc.environ().get("DISTREPRO_TEST_SESSION") == TEST_SESSION:
                    alive.append(proc)
            except psutil.Error:
                pass  # exited meanwhile
    return alive


@pytest.fixture(autouse=True)
def stop_training_processes_the_test_left():
    """A test that fails or times out still stops the training processes it started."""
    import psutil

    before = {proc.pid for proc in training_processes()}
    yield
    left = [proc for proc in training_processes() if proc.pid not in before]
    for proc in left:
        proc.kill()
    psutil.wait_procs(left, timeout=10)


def peak_learning_rates(runs) -> dict[int, float]:
    """{global batch: peak learning rate} of MLflow runs."""
    return {
        int(r.data.params["train.global_batch_size"]): float(r.data.params["peak_learning_rate"])
        for r in runs
    }
