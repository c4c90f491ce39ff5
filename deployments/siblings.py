"""`n` > 1: one request's choices as sibling engine requests, their chunks merged into one stream.

Sibling 0 runs first; the others start once its first chunk is out, that is once its prompt is
prefilled and its full blocks are keyed in the prefix cache, so every sibling after it holds
those blocks and prefills only the prompt's tail (the rule of
docs/decisions/0028-prefix-caching.md; vLLM serves `n` the same way, as child requests on its
prefix cache). Started together, the siblings would each prefill the whole prompt in one step.
Each chunk keeps its sibling's `index` and says how many siblings still run (`remaining`), so
the ingress knows the last one. An error in any sibling ends the stream (the ingress answers
it); ending the stream, however it ends, cancels every sibling, which aborts its sequence.

Owns the merge. Does not own what a sibling runs (`deployments/engine_server.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from router.wire import GenerateChunk


async def merged(first: AsyncIterator[GenerateChunk],
                 start: Callable[[int, GenerateChunk], AsyncIterator[GenerateChunk]],
                 n: int) -> AsyncIterator[GenerateChunk]:
    """The chunks of `n` siblings as they come: `first` is sibling 0's stream, and
    `start(i, sibling 0's first chunk)` makes sibling i's (i = 1..n-1)."""
    head = await first.__anext__()
    queue: asyncio.Queue = asyncio.Queue()
    streams = [first] + [start(i, head) for i in range(1, n)]
    tasks = [asyncio.create_task(_pump(i, s, queue, head if i == 0 else None))
             for i, s in enumerate(streams)]
    done = int(head.finished)
    try:
        yield dataclasses.replace(head, index=0, remaining=n - done)
        while done < n:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            done += item.finished
            yield dataclasses.replace(item, remaining=n - done)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:       # a stream a task never reached still holds its sequence
            await stream.aclose()


async def _pump(index: int, stream: AsyncIterator[GenerateChunk], queue: asyncio.Queue,
                last: GenerateChunk | None) -> None:
    """Sibling `index`'s chunks into the queue. A stream that stops before its finished chunk
    (the engine aborted it) ends as an abort with the counts it had; an error goes on as is."""
    if last is not None and last.finished:
        return
    try:
        async for chunk in stream:
            last = dataclasses.replace(chunk, index=index)
            await queue.put(last)
            if chunk.finished:
                return
        base = last or GenerateChunk(text="")
        await queue.put(dataclasses.replace(base, index=index, text="", token_ids=[],
                                            logprobs=None, prompt_logprobs=None,
                                            prompt_text=None, finished=True,
                                            finish_reason="abort"))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await queue.put(exc)
