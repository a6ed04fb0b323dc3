"""The depthwise causal convolution in front of the recurrent layers (gated DeltaNet, Mamba-2), token-major.

``x [T, C]`` (each token's C channels, as the input projection gives them) is convolved per channel with a
kernel of K taps over the token axis, the K-1 tokens before the step coming from the sequence's conv state
``[C, K-1]`` (zeros at its start); the state then holds the step's last K-1 inputs. Written as K shifted
multiply-adds over the token-major rows: torch's grouped ``conv1d`` wants channel-major input (a transposed copy
of the whole step) and runs a depthwise kernel of thousands of groups slowly on the CPU (Nemotron-3-Nano's 6144
channels at 4096 tokens: 1.05 s for the copy and the conv, 0.1 s this way).
"""

from __future__ import annotations

import torch


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, C]``, ``conv_state [C, K-1]`` (updated in place), ``weight [C, K]`` (tap K-1 on the current token),
    ``bias [C]`` -> ``[T, C]`` float32, before the activation."""
    t = x.shape[0]
    k = weight.shape[1]
    padded = torch.cat([conv_state.t().to(torch.float32), x.to(torch.float32)], dim=0)  # [K-1+T, C]
    taps = weight.t().to(torch.float32)  # [K, C]
    out = padded[k - 1:] * taps[k - 1] if bias is None else torch.addcmul(bias.float(), padded[k - 1:], taps[k - 1])
    for j in range(k - 1):
        out.addcmul_(padded[j:j + t], taps[j])
    if k > 1:
        conv_state.copy_(padded[-(k - 1):].t())
    return out
