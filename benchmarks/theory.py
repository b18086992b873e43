"""The communication bound of the paper's Theorem 2, evaluated on a run's own numbers.

The paper's formulas did not survive our copy's text extraction; this is the bound as its proof
sketch builds it (Lemma 2: SGD with the norm test, after Byrd et al. 2012; Lemma 3: Jensen over the
trainers and the H inner steps between synchronisations). ASSUMPTIONS, all idealised:
  * F is L-smooth and bounded below by F_inf (cross-entropy: F_inf >= 0, we use 0);
  * every step satisfies the norm test with parameter eta exactly (E||g_B - g||^2 <= eta^2 ||g||^2);
  * the inner optimizer is SGD with step alpha <= 1 / (L (1 + eta^2)).
Then min_k E||grad F(x_k)||^2 <= 2 (F(x_0) - F_inf) / (alpha T) after T steps, so reaching
E||grad F||^2 <= eps takes at most T = 2 (F(x_0) - F_inf) / (alpha eps) steps, i.e. at most
    K = ceil( 2 (F(x_0) - F_inf) / (alpha * H * eps) )
rounds (outer steps: each trainer synchronises once per round), with H = num_inner_steps.
From a run: F(x_0) = the first round's training loss, alpha = lr_inner, eps = the squared gradient norm
the last batch test measured. With AdamW inner steps the SGD assumption does not hold, so the number
is a reference point, not a guarantee.
"""

from __future__ import annotations

import math


def communication_bound(cfg, run: dict) -> float | None:
    """K for one run (see the module docstring); None when the run logged no gradient norm."""
    if not run.get("grad_sq_norm"):
        return None
    eps = run["grad_sq_norm"][-1]
    if eps <= 0:
        return None
    return float(math.ceil(2 * run["train_loss_first"] / (cfg.lr_inner * cfg.num_inner_steps * eps)))
