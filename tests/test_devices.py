"""``oommagic.devices``: NVML's view of the GPUs, mapped to CUDA ordinals, and the ``%gpumem`` table.

No GPU here: the cards are a stand-in for the ``pynvml`` module (the hardware edge) that raises
pynvml's own error classes; the real ``pynvml`` is used where this machine can answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest

from oommagic.devices import DeviceReport, cuda_ordinals, read_devices, render_devices_text

GiB = 1024**3


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class Card:
    """One GPU as the stand-in reports it; ``fail`` maps a pynvml function name to the error it raises."""

    uuid: str
    name: str | bytes = "NVIDIA H200"
    total: int = 140 * GiB
    used: int = 4 * GiB
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    fail: dict[str, pynvml.NVMLError] = field(default_factory=dict)
    mig: dict[str, str] = field(default_factory=dict)  # MIG instance UUID → this card


class FakeNvml:
    """The subset of the ``pynvml`` API that ``read_devices`` calls, over a list of ``Card``s."""

    def __init__(
        self,
        cards: list[Card],
        *,
        driver: str | bytes = "550.54.15",
        process_names: dict[int, str | bytes] | None = None,
        fail: dict[str, pynvml.NVMLError] | None = None,
    ) -> None:
        self.cards = cards
        self.driver = driver
        self.process_names = process_names or {}
        self.fail = fail or {}
        self.sessions = 0

    def _check(self, call: str, card: Card | None = None) -> None:
        error = (card.fail if card else self.fail).get(call)
        if error is not None:
            raise error

    def nvmlInit(self) -> None:
        self._check("nvmlInit")
        self.sessions += 1

    def nvmlShutdown(self) -> None:
        self.sessions -= 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Card:
        self._check("nvmlDeviceGetHandleByIndex", self.cards[index])
        return self.cards[index]

    def nvmlDeviceGetUUID(self, card: Card) -> str:
        self._check("nvmlDeviceGetUUID", card)
        return card.uuid

    def nvmlDeviceGetName(self, card: Card) -> str | bytes:
        self._check("nvmlDeviceGetName", card)
        return card.name

    def nvmlDeviceGetMemoryInfo(self, card: Card) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo", card)
        return SimpleNamespace(total=card.total, used=card.used, free=card.total - card.used)

    def nvmlDeviceGetComputeRunningProcesses(self, card: Card) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetComputeRunningProcesses", card)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in card.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(self, card: Card) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetGraphicsRunningProcesses", card)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in card.graphics]

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        if pid not in self.process_names:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self.process_names[pid]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> tuple[str, Card]:
        for card in self.cards:
            if uuid in card.mig:
                return ("mig", card)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: tuple[str, Card]) -> Card:
        return mig[1]


def three_cards() -> list[Card]:
    return [
        Card("GPU-aaaa1111-0000-0000-0000-000000000000"),
        Card("GPU-bbbb2222-0000-0000-0000-000000000000"),
        Card("GPU-bbbb3333-0000-0000-0000-000000000000"),
    ]


def ordinals(report: DeviceReport) -> dict[int, int | None]:
    return {gpu.nvml_index: gpu.cuda_index for gpu in report.devices}


@pytest.fixture
def visible(monkeypatch: pytest.MonkeyPatch):
    """Set (or, with None, unset) CUDA_VISIBLE_DEVICES for one read."""

    def set_visible(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)

    return set_visible


# --- CUDA_VISIBLE_DEVICES ------------------------------------------------------------------------


def test_without_cuda_visible_devices_ordinals_follow_nvml(visible) -> None:
    visible(None)
    assert ordinals(read_devices(FakeNvml(three_cards()))) == {0: 0, 1: 1, 2: 2}


def test_cuda_visible_devices_maps_ordinals(visible) -> None:
    visible("2,0")
    report = read_devices(FakeNvml(three_cards()))
    assert ordinals(report) == {0: 1, 1: None, 2: 0}


def test_hidden_cards_are_still_listed(visible) -> None:
    visible("1")
    report = read_devices(FakeNvml(three_cards()))
    assert [gpu.nvml_index for gpu in report.devices] == [0, 1, 2]
    assert all(gpu.total == 140 * GiB for gpu in report.devices)


def test_empty_cuda_visible_devices_hides_every_card(visible) -> None:
    visible("")
    assert ordinals(read_devices(FakeNvml(three_cards()))) == {0: None, 1: None, 2: None}


def test_uuid_entries_map_ordinals_by_prefix(visible) -> None:
    visible("GPU-bbbb3333,GPU-aaaa")
    assert ordinals(read_devices(FakeNvml(three_cards()))) == {0: 1, 1: None, 2: 0}


def test_mig_instance_maps_to_the_card_holding_it(visible) -> None:
    cards = three_cards()
    cards[1].mig["MIG-5c89b2f0-0000-0000-0000-000000000000"] = cards[1].uuid
    visible("MIG-5c89b2f0-0000-0000-0000-000000000000")
    assert ordinals(read_devices(FakeNvml(cards))) == {0: None, 1: 0, 2: None}


def test_unknown_mig_instance_hides_every_card(visible) -> None:
    visible("MIG-00000000-dead-beef-0000-000000000000")
    assert ordinals(read_devices(FakeNvml(three_cards()))) == {0: None, 1: None, 2: None}


UUIDS = [card.uuid for card in three_cards()]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1,-1,0", {1: 0}),  # a negative entry ends the list
        ("1,7,0", {1: 0}),  # so does an index past the last card
        ("0,x,2", {0: 0}),  # and anything that is no number or UUID
        ("1gpu,2", {1: 0, 2: 1}),  # CUDA reads integers like strtoul
        (" 2 , 1", {2: 0, 1: 1}),
        ("0,0", {}),  # a card named twice hides every card
        ("GPU-aaaa,0", {}),
        ("GPU-bbbb,0", {}),  # ambiguous prefix names no card: the list ends before it
        ("GPU-ffff", {}),
        ("MIG-GPU-bbbb3333-0000-0000-0000-000000000000/1/0", {2: 0}),  # CUDA < 11.1 MIG form
        ("MIG-GPU-aaaa1111-0000-0000-0000-000000000000/1/0,1", {0: 0}),  # one MIG instance only
    ],
)
def test_cuda_visible_devices_follows_the_cuda_runtime(value: str, expected: dict[int, int]) -> None:
    assert cuda_ordinals(value, UUIDS) == expected


# --- errors --------------------------------------------------------------------------------------


def test_one_failing_device_still_lists_the_others(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[1].fail["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    report = read_devices(FakeNvml(cards))
    assert report.available
    assert [gpu.error for gpu in report.devices] == [None, "GPU is lost", None]
    assert report.devices[1].total is None
    assert report.devices[0].total == report.devices[2].total == 140 * GiB
    # Ordinals still count the broken card: CUDA enumerates it too.
    assert ordinals(report) == {0: 0, 1: 1, 2: 2}


def test_a_refused_query_keeps_the_figures_that_were_read(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[0].fail["nvmlDeviceGetMemoryInfo"] = nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    gpu = read_devices(FakeNvml(cards)).devices[0]
    assert (gpu.name, gpu.uuid) == ("NVIDIA H200", cards[0].uuid)
    assert (gpu.used, gpu.total, gpu.free) == (None, None, None)
    assert gpu.error == "memory: Insufficient Permissions"


def test_unsupported_process_list_leaves_memory_figures(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[0].fail["nvmlDeviceGetComputeRunningProcesses"] = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gpu = read_devices(FakeNvml(cards)).devices[0]
    assert gpu.used == 4 * GiB
    assert gpu.processes == ()
    assert gpu.error == "processes: Not Supported"


def test_without_a_driver_the_report_says_why() -> None:
    nvml = FakeNvml([], fail={"nvmlInit": nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)})
    report = read_devices(nvml)
    assert report == DeviceReport(available=False, error="Driver Not Loaded", driver=None, devices=())


def test_failing_device_count_makes_nvml_unavailable() -> None:
    nvml = FakeNvml(three_cards(), fail={"nvmlDeviceGetCount": nvml_error(pynvml.NVML_ERROR_UNKNOWN)})
    report = read_devices(nvml)
    assert (report.available, report.error, report.devices) == (False, "Unknown Error", ())
    assert nvml.sessions == 0


def test_zero_gpus_is_an_available_empty_report() -> None:
    report = read_devices(FakeNvml([]))
    assert (report.available, report.error, report.driver, report.devices) == (True, None, "550.54.15", ())


def test_without_pynvml_the_report_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    report = read_devices()
    assert not report.available
    assert "pip install nvidia-ml-py" in (report.error or "")


def test_a_strange_answer_from_nvml_does_not_raise() -> None:
    nvml = FakeNvml(three_cards())
    nvml.nvmlDeviceGetCount = lambda: "three"  # type: ignore[method-assign]
    report = read_devices(nvml)
    assert not report.available
    assert report.error and report.error.startswith("unexpected answer from NVML")


def test_nvml_is_shut_down_after_every_read(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[2].fail["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    nvml = FakeNvml(cards)
    read_devices(nvml)
    assert nvml.sessions == 0


# --- processes -----------------------------------------------------------------------------------


def test_processes_carry_pid_name_and_bytes(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[0].compute = [(4242, 10 * GiB), (5151, None)]
    cards[0].graphics = [(4242, 10 * GiB), (6000, 1 * GiB)]
    nvml = FakeNvml(cards, process_names={4242: b"/usr/bin/python3", 6000: "Xorg"})
    processes = {p.pid: (p.name, p.used) for p in read_devices(nvml).devices[0].processes}
    assert processes == {
        4242: ("/usr/bin/python3", 10 * GiB),  # in both lists, listed once; bytes name decoded
        5151: (None, None),  # name unreadable (other user, or host PID in a container); no figure
        6000: ("Xorg", 1 * GiB),
    }


def test_bytes_from_older_nvml_bindings_are_decoded(visible) -> None:
    visible(None)
    report = read_devices(FakeNvml([Card("GPU-aaaa", name=b"Tesla T4")], driver=b"470.82.01"))
    assert (report.driver, report.devices[0].name) == ("470.82.01", "Tesla T4")


def test_report_is_plain_json(visible) -> None:
    visible("1")
    cards = three_cards()
    cards[1].compute = [(4242, GiB)]
    data = json.loads(json.dumps(read_devices(FakeNvml(cards, process_names={4242: "python"})).to_json()))
    assert set(data) == {"available", "error", "driver", "devices"}
    assert data["devices"][1] == {
        "nvml_index": 1,
        "cuda_index": 0,
        "uuid": cards[1].uuid,
        "name": "NVIDIA H200",
        "used": 4 * GiB,
        "total": 140 * GiB,
        "free": 136 * GiB,
        "processes": [{"pid": 4242, "name": "python", "used": GiB}],
        "error": None,
    }


# --- the real pynvml on this machine ---------------------------------------------------------------


def test_real_nvml_answers_without_raising() -> None:
    report = read_devices()
    if report.available:
        assert all(gpu.total and gpu.total > 0 for gpu in report.devices if gpu.error is None)
    else:
        assert report.error and report.devices == ()
        assert "NVML is not available" in render_devices_text(report)


@pytest.mark.gpu
def test_real_nvml_lists_the_gpus_torch_sees() -> None:
    report = read_devices()
    if not report.available:
        pytest.skip(f"no NVML on this machine: {report.error}")
    torch = pytest.importorskip("torch")
    visible = [gpu for gpu in report.devices if gpu.cuda_index is not None]
    assert len(visible) == torch.cuda.device_count()
    for gpu in visible:
        assert gpu.name == torch.cuda.get_device_name(gpu.cuda_index)


def test_importing_devices_does_not_import_pynvml() -> None:
    code = "import sys, oommagic.devices; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# --- the %gpumem text ----------------------------------------------------------------------------


def test_without_nvml_the_text_says_why() -> None:
    report = DeviceReport(available=False, error="NVML Shared Library Not Found", driver=None, devices=())
    text = render_devices_text(report)
    assert text.startswith("NVML is not available (NVML Shared Library Not Found): no GPU figures.")


def test_without_nvml_the_text_still_shows_pytorch_figures() -> None:
    report = DeviceReport(available=False, error="NVML Shared Library Not Found", driver=None, devices=())
    text = render_devices_text(report, this_process={0: (GiB, 2 * GiB)})
    assert "cuda:0: this process has 1.00 GiB allocated, 2.00 GiB reserved by PyTorch" in text


def test_text_lists_each_card_with_this_process_and_the_others(visible) -> None:
    visible("2,0")
    cards = three_cards()
    cards[2].compute = [(4242, 10 * GiB), (os.getpid(), 3 * GiB)]
    nvml = FakeNvml(cards, process_names={4242: "python3", os.getpid(): "python"})
    text = render_devices_text(read_devices(nvml), this_process={0: (GiB, 2 * GiB)})
    lines = text.splitlines()
    assert lines[0] == "GPU memory from NVML (driver 550.54.15)"
    assert lines[1].split() == ["device", "nvml", "name", "used", "total", "free"]
    assert lines[2].split() == [
        "cuda:0",
        "2",
        "NVIDIA",
        "H200",
        "4.00",
        "GiB",
        "140.00",
        "GiB",
        "136.00",
        "GiB",
    ]
    assert lines[3].strip() == "this process: 1.00 GiB allocated, 2.00 GiB reserved by PyTorch"
    assert lines[4].strip() == "PID 4242  python3  10.00 GiB"
    assert lines[5].strip() == f"PID {os.getpid()}  python  3.00 GiB  (this process)"
    assert lines[6].split()[:2] == ["cuda:1", "0"]
    assert "hidden" in lines[-3] and "not visible to this process" in lines[-2]


def test_text_marks_a_failing_card(visible) -> None:
    visible(None)
    cards = three_cards()
    cards[1].fail["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    text = render_devices_text(read_devices(FakeNvml(cards)))
    assert "NVML error: GPU is lost" in text
    assert text.count("140.00 GiB") == 2


def test_text_with_zero_gpus() -> None:
    assert render_devices_text(read_devices(FakeNvml([]))) == "NVML found no GPUs (driver 550.54.15)."
