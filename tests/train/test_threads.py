"""CPU threads per training process: accelerate launch leaves OMP_NUM_THREADS=1; cpu_threads=auto shares
the physical cores between the processes of the machine instead."""

import torch

from headway.train.threads import physical_cores, threads_for, use_cpu_threads


def test_auto_shares_the_physical_cores_between_local_processes(monkeypatch):
    monkeypatch.setattr("headway.train.threads.physical_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert threads_for("auto") == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads_for("auto") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert threads_for("auto") == 1  # never 0
    assert threads_for("3") == 3 and threads_for(5) == 5


def test_the_setting_reaches_torch_whatever_omp_num_threads_said(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what accelerate launch exports
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        assert use_cpu_threads("auto") == physical_cores() == torch.get_num_threads()
        assert use_cpu_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
