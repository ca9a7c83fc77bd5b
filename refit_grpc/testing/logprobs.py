"""Teacher-forced log-probabilities on the trainer's side: what an engine must reproduce for every
position of a fixed sequence (the vLLM truth tests, the Dynamo tests and `make demo-dynamo`)."""

from __future__ import annotations

from collections.abc import Sequence

# 26 tokens. The first 20 follow the toy pattern the demos and tests train on
# (t[i+1] = 5 t[i] + 3 mod 512, `refit_grpc.testing.vllm.toy_batch`), so the log-probabilities
# move with training; the last 6 do not, so they are not all predictable ones.
SEQUENCE = [7]
for _ in range(19):
    SEQUENCE.append((5 * SEQUENCE[-1] + 3) % 512)
SEQUENCE += [11, 400, 3, 250, 77, 9]


def hf_logprobs(model, sequence: Sequence[int] = SEQUENCE):
    """log p(sequence[i] | sequence[:i]) for i = 1 .. n-1, from one transformers forward (in the
    model's own dtype; log_softmax in float64)."""
    import torch

    ids = torch.tensor([list(sequence)])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
