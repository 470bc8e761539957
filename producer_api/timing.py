"""TGI's timing headers on /generate: durations in milliseconds, x-compute-time in seconds."""

from __future__ import annotations

from shared.schemas import FinalResult


def tgi_headers(
    *, arrived: float, validated: float, finished: float, result: FinalResult, device: str, prompt_chars: int
) -> dict[str, str]:
    """``arrived``/``validated``/``finished`` are perf_counter readings; queue and inference times come
    from the worker's timings, so they hold across several API replicas."""
    total = finished - arrived
    queue = result.timings.queue_time_s
    inference = result.timings.inference_time_s
    generated = result.usage.completion_tokens
    return {
        "x-compute-type": device,
        "x-compute-time": f"{total:.6f}",
        "x-compute-characters": str(prompt_chars),
        "x-total-time": str(round(total * 1000)),
        "x-validation-time": str(round((validated - arrived) * 1000)),
        "x-queue-time": str(round(queue * 1000)),
        "x-inference-time": str(round(inference * 1000)),
        "x-time-per-token": str(round(inference * 1000 / generated) if generated else 0),
        "x-prompt-tokens": str(result.usage.prompt_tokens),
        "x-generated-tokens": str(generated),
        "x-request-id": result.request_id,
    }
