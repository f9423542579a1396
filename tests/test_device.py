"""Where stages compute: runtime.device (auto | cpu | cuda) through POSTTRAIN_DEVICE."""
import pytest
import torch

from posttrain.device import ENV, device, stage_gpus


def test_auto_picks_cuda_only_where_there_is_one(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(ENV, "cpu")
    assert device().type == "cpu" and stage_gpus("cpu", 1.0) == 0.0


# deliberate: the refusal can only be observed where torch sees no CUDA device (the CI machines)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_one_fails_naming_the_setting(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(RuntimeError, match=r"runtime\.device"):
        device()


def test_training_leaves_cudnn_attention_off_on_hopper_unless_asked(monkeypatch):
    # its backward returns NaN for masked rows there (posttrain.device.cudnn_sdpa_trusted); other GPUs keep it
    from posttrain.device import CUDNN_SDPA, cudnn_sdpa_trusted
    monkeypatch.delenv(CUDNN_SDPA, raising=False)
    assert not cudnn_sdpa_trusted((9, 0)) and cudnn_sdpa_trusted((8, 0)) and cudnn_sdpa_trusted((10, 0))
    monkeypatch.setenv(CUDNN_SDPA, "1")
    assert cudnn_sdpa_trusted((9, 0))


def test_runtime_cpu_bf16_runs_cpu_training_forwards_under_bf16_autocast(monkeypatch):
    import torch

    from posttrain.device import CPU_BF16, autocast
    x = torch.ones(4, 4)
    with autocast(torch.device("cpu")):
        assert (x @ x).dtype == torch.float32  # the embedded default computes in fp32
    monkeypatch.setenv(CPU_BF16, "1")
    with autocast(torch.device("cpu")):
        assert (x @ x).dtype == torch.bfloat16


def test_cpu_bf16_auto_follows_the_cpus_native_bf16(monkeypatch, tmp_path, capsys):
    """auto: bf16 autocast only where the CPU multiplies bf16 in hardware (elsewhere torch emulates it, 9x slower
    than fp32 on an AVX2-only EPYC); true is obeyed anyway, with a warning."""
    import torch

    import posttrain.device as device
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx2 fma\n")
    assert not device.native_cpu_bf16(str(info))
    info.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n")
    assert device.native_cpu_bf16(str(info))
    x = torch.ones(4, 4)
    for native in (False, True):
        monkeypatch.setattr(device, "native_cpu_bf16", lambda native=native: native)
        monkeypatch.setenv(device.CPU_BF16, "auto")
        with device.autocast(torch.device("cpu")):
            assert (x @ x).dtype == (torch.bfloat16 if native else torch.float32)
    monkeypatch.setattr(device, "native_cpu_bf16", lambda: False)
    monkeypatch.setenv(device.CPU_BF16, "1")
    device._say_emulated.cache_clear()  # said once per process
    with device.autocast(torch.device("cpu")):
        assert (x @ x).dtype == torch.bfloat16
    assert "emulated" in capsys.readouterr().out
