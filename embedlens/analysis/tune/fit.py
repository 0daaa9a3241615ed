"""The closed-form start: for each layer l, the least-squares affine map from its residual to the
last layer's, from sufficient statistics streamed over the data.

For residual rows x (layer l) and y (layer L), the translator minimises Σ |y - (x + W x + b)|²
+ λ n |W|² (ridge toward the identity, as weight decay is in the refinement): with the
covariances C_xx and C_xy, Wᵀ = (C_xx + λ I)⁻¹ (C_xy - C_xx) and b = mean(y) - mean(x) - W mean(x).
Per layer only the sums of x, y, x xᵀ and x yᵀ are kept, taken after subtracting the first
batch's means (so that the residual stream's large mean does not cancel the digits of its
spread): memory does not grow with the tokens read. Each batch's d x d products are float32, their
running sums float64, as are the vectors and the solve: the solve turns a change in the last bits
of float32 sums (1e-7 of an entry) into one of 1e-4 in SmolLM2's translators, so summed in
float32 the lens would follow the order of the sums (another in a run split over processes, which
adds its parts' sums).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embedlens.analysis.lens.decoders import Translators

RIDGE = 1e-4
"""λ, relative to the mean variance of the layer's residual (trace(C_xx) / d)."""


class LeastSquares:
    """Streamed sums for the least-squares translators of layers 0..L-1."""

    def __init__(
        self, num_layers: int, width: int, shift: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """`shift`: the means subtracted (`means`), else the first batch's."""
        self.num_layers = num_layers
        self.width = width
        self.n = 0
        self.shift_x: torch.Tensor | None = None if shift is None else shift[0]
        self.shift_y: torch.Tensor | None = None if shift is None else shift[1]
        self.sum_x = torch.zeros(num_layers, width, dtype=torch.float64)
        self.sum_y = torch.zeros(width, dtype=torch.float64)
        self.xx = torch.zeros(num_layers, width, width, dtype=torch.float64)
        self.xy = torch.zeros(num_layers, width, width, dtype=torch.float64)

    @staticmethod
    def means(
        residual: dict[int, torch.Tensor], num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's means at layers 0..L-1 ([L, d]) and at layer L ([d]): the shift."""
        x = torch.stack([residual[i].detach().float().cpu().mean(0) for i in range(num_layers)])
        return x, residual[num_layers].detach().float().cpu().mean(0)

    def add(self, residual: dict[int, torch.Tensor]) -> None:
        """Rows of one batch: residual[l] is [n, d] at layer l (0..L), the same rows at each."""
        last = residual[self.num_layers].detach().float().cpu()
        if self.shift_x is None:
            self.shift_x, self.shift_y = self.means(residual, self.num_layers)
        assert self.shift_x is not None and self.shift_y is not None
        y = last - self.shift_y
        self.n += int(y.shape[0])
        self.sum_y += y.sum(0, dtype=torch.float64)
        for layer in range(self.num_layers):
            x = residual[layer].detach().float().cpu() - self.shift_x[layer]
            self.sum_x[layer] += x.sum(0, dtype=torch.float64)
            self.xx[layer] += x.T @ x
            self.xy[layer] += x.T @ y

    def reduce(self, all_reduce: Callable[[torch.Tensor], None]) -> None:
        """The sums of every process added (`all_reduce` sums a tensor over them in place; the
        shift must be the same in each)."""
        count = torch.tensor([self.n], dtype=torch.float64)
        for total in (count, self.sum_x, self.sum_y, self.xx, self.xy):
            all_reduce(total)
        self.n = int(count)

    def solve(
        self, ridge: float = RIDGE, on_layer: Callable[[int], None] | None = None
    ) -> Translators:
        """The translators that minimise the squared error (with the ridge toward identity);
        `on_layer(done)` after each layer's."""
        assert self.n > 0 and self.shift_x is not None and self.shift_y is not None
        d, n = self.width, self.n
        weight = torch.zeros(self.num_layers, d, d, dtype=torch.float32)
        bias = torch.zeros(self.num_layers, d, dtype=torch.float32)
        mean_y = self.sum_y / n
        eye = torch.eye(d, dtype=torch.float64)
        for layer in range(self.num_layers):
            mean_x = self.sum_x[layer] / n
            cxx = self.xx[layer] / n - torch.outer(mean_x, mean_x)
            cxy = self.xy[layer] / n - torch.outer(mean_x, mean_y)
            reg = ridge * float(torch.trace(cxx)) / d + 1e-12
            wt = _solve(cxx + reg * eye, cxy - cxx)
            w = wt.T
            x0 = mean_x + self.shift_x[layer].double()
            y0 = mean_y + self.shift_y.double()
            weight[layer] = w.float()
            bias[layer] = (y0 - x0 - w @ x0).float()
            if on_layer is not None:
                on_layer(layer + 1)
        return Translators(weight, bias)


def _solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a⁻¹ b for a symmetric positive semi-definite a (its pseudo-inverse when singular)."""
    try:
        out: torch.Tensor = torch.linalg.solve(a, b)
    except RuntimeError:  # torch.linalg.LinAlgError: a singular matrix
        out = torch.linalg.pinv(a, hermitian=True) @ b
    return out
