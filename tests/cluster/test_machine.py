"""What a benchmark's JSON says about its machine (cluster/bench/machine.py)."""

from cluster.bench.machine import cpu_model, describe

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: another core's line, not read
"""


def test_the_cpu_model_and_the_flags_that_change_the_kernels_are_read():
    assert cpu_model(CPUINFO) == ("Intel(R) Xeon(R) Processor",
                                  ["avx2", "avx512f", "avx512_bf16", "amx_bf16"])
    assert cpu_model("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n") == ("AMD EPYC", ["avx2"])


def test_describe_names_this_machine_and_keeps_what_the_caller_adds():
    machine = describe(torch="x")
    assert machine["cpu"] and machine["cpus"] >= 1 and machine["torch"] == "x"
    assert set(machine["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
