"""Medusa-1 (Cai et al. 2024): K heads on the target's last hidden state propose a candidate
tree, verified in one target forward with tree attention.

Head k, applied to the hidden state of the last position the target cache holds, predicts the
token k + 2 positions after it: the (k + 1)-th token after the last emitted one (the emitted
token is the root of the tree, as Medusa's root is the base model's own next token). The tree
is Medusa's cartesian candidate tree: level k + 1 holds, below every node of level k, the
top-``branching[k]`` tokens of head k (4,2,2: 4 + 8 + 16 = 28 nodes). The heads run once per
iteration on one hidden state per row (a draft forward, timed as draft); the verify forward
returns every node's hidden state, and the accepted node's feeds the heads next time.

Acceptance (``acceptance``): ``typical`` (Medusa's, lossy): the deepest node whose path passes
p(x) > min(eps, delta * exp(-H(p))) under the temperature-scaled, untruncated target (as the
``typical`` decoder), ties by the joint likelihood; the next token from ~p there. ``speculative``
(lossless): the candidates' q is one-hot at their own token (`rules.tree.tree_candidates_accept`).
Both equal greedy ``ar`` at temperature 0.

Stats: ``proposed`` = the tree's nodes, ``draft_depth`` = its depth (per row: a row near its
end uses only the levels it can still emit), ``accepted`` = the accepted node's depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.sampling import sample_u, split_uniforms, warp_probs
from mtad_energy.decoding.rules.tree import tree_candidates_accept_u, tree_typical_accept
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.head_runner import HeadCall, prefill_features
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens
from mtad_energy.decoding.runtime.tree import rooted_tree, set_branching, tree_nodes, tree_verify

ACCEPTANCE = ("typical", "speculative")


@dataclass(frozen=True)
class MedusaParams(DecoderParams):
    branching: tuple[int, ...] = param((4, 2, 2), "top tokens of head k at tree level k+1 "
                                                  "(levels <= the checkpoint's heads)")
    acceptance: str = param("typical", "typical (Medusa's, lossy) or speculative (lossless)")
    eps: float = param(0.09, "typical: accept x if p(x) > min(eps, delta*exp(-H(p)))",
                       ("acceptance", "typical"))
    delta: float = param(0.3, "typical: entropy-scaled threshold factor (Medusa's alpha)",
                         ("acceptance", "typical"))

    def validate(self) -> None:
        set_branching(self)
        require(self.acceptance in ACCEPTANCE,
                f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")
        require(0.0 < self.eps <= 1.0, f"eps must be in (0, 1] (a probability), got {self.eps}")
        require(self.delta > 0.0, f"delta must be > 0, got {self.delta}")


def candidate_tokens(logits: torch.Tensor, branching: tuple[int, ...]) -> torch.Tensor:
    """Kernel: ``logits [B, K, V]`` of the heads -> the tree's node tokens ``[B, N]``, levels in
    order: node j of level k is the (j mod b_k)-th most likely token of head k."""
    levels, width = [], 1
    for k, b in enumerate(branching):
        top = logits[:, k].topk(b, -1).indices  # [B, b]
        width *= b
        levels.append(top[:, torch.arange(width, device=top.device) % b])
    return torch.cat(levels, 1)


class Medusa(Decoder):
    name = "medusa"
    help = ("Medusa-1: K heads on the target's last hidden state propose a candidate tree, "
            "typical (lossy) or speculative (lossless) acceptance; --draft medusa:DIR")
    Params = MedusaParams
    batched = True
    drafts_without_model = True
    head = "medusa"

    @property
    def lookahead(self) -> int:
        return len(self.params.branching)

    @property
    def verify_width(self) -> int:
        return 1 + tree_nodes(self.params.branching)

    def target_hidden(self, pair) -> tuple[int, ...]:
        return (-1,)  # the last layer's output, after the final norm

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """The target's tree verify (`verify_width` nodes, one tree for all rows); the heads'
        candidate trees of every depth (a generation's last iterations draft fewer levels)."""
        branching = self.params.branching
        if role == "target":
            return super().warm_forwards(role, pair) + ((self.verify_width, 0),)
        width = pair.heads["medusa"].config["hidden_size"]
        return tuple(HeadCall(width, candidate_tokens, (branching[:n],))
                     for n in range(1, len(branching) + 1))

    def prefill(self, s: DecodeState) -> None:
        heads = s.draft.model
        vocab = heads.config["vocab_size"]
        require(max(self.params.branching) <= vocab,
                f"medusa: branching {self.params.branching} asks for more candidates than the "
                f"{vocab} tokens of the vocabulary")
        require(heads.num_heads >= len(self.params.branching),
                f"medusa: branching {self.params.branching} has {len(self.params.branching)} "
                f"levels but the checkpoint has {heads.num_heads} heads; give at most "
                f"{heads.num_heads} levels (e.g. --set branching=...)")
        s.carry["hidden"] = prefill_features(s, heads.config["hidden_size"])[:, 0]

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        warp = prm.warp
        lens = self.draft_lens(s)
        branching = prm.branching[:max(lens)]
        if not branching:  # one token left: no point drafting
            out = target_step(s, warp)
            s.carry["hidden"] = s.target.hidden[:, -1]
            return out
        tokens = s.draft.then(s.calls, s.carry["hidden"], candidate_tokens, branching)  # [B, N]
        parents, anc = rooted_tree(branching, s.device)
        full = torch.cat([s.last_token, tokens], 1)  # [B, 1 + N]: the root first
        speculative = prm.acceptance == "speculative"
        # the verify's forward (returning every node's features) and its rule: one graph call
        draws = ((full.numel(), 1),) if speculative else ()  # the rule's, then the next token's
        feat, recent, read = tree_verify(
            s.target, s.calls, full, anc, medusa_verify, full, parents, anc,
            s.on_device(lens), s.uniforms(*draws, (s.batch, 1)), s.recent, len(branching),
            speculative, prm.eps, prm.delta, *warp.args)
        s.carry["hidden"] = feat  # the deepest accepted node's: the heads' next input
        nodes = tuple(tree_nodes(branching[:n]) for n in lens)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=nodes,
                                    depth=lens)


def medusa_verify(logits: torch.Tensor, hidden: torch.Tensor, full: torch.Tensor,
                  parents: torch.Tensor, anc: torch.Tensor, caps: torch.Tensor,
                  u: torch.Tensor, recent: torch.Tensor, levels: int, speculative: bool,
                  eps: float, delta: float, temperature: float, top_k: int, top_p: float
                  ) -> tuple[torch.Tensor, ...]:
    """Kernel: the acceptance rule on the verified tree (``logits [B, 1 + N, V]`` of ``full [B,
    1 + N]``, the root first; ``caps [B]``: each row's depth), speculative
    (`tree_candidates_accept_u`, its uniforms ``[B * (1 + N), 1]``) or typical
    (`tree_typical_accept`), the next token (one uniform ``[B, 1]``; ``u``: the rule's, if
    speculative, then these, flat) and the block: ``(block [B, L+1], depth, length [B], path [B,
    1+L], features [B, F], recent, read)``, path: the nodes to keep (the root first), features:
    ``hidden [B, 1 + N, F]`` (every node's) at the deepest accepted node (`block_out`:
    ``recent``, ``read``)."""
    rows = full.shape[0]
    if speculative:
        depth, path, nxt, node = tree_candidates_accept_u(
            warp_probs(logits, temperature, top_k, top_p), full, parents, anc, caps, levels,
            *split_uniforms(u, (full.numel(), 1), (rows, 1)))
    else:
        p_test = warp_probs(logits, temperature, top_k=0, top_p=1.0)
        depth, path, node = tree_typical_accept(p_test, full, parents, anc, caps, levels, eps,
                                                delta)
        at = node[:, None, None].expand(-1, 1, logits.shape[-1])
        nxt = sample_u(warp_probs(logits.gather(1, at)[:, 0], temperature, top_k, top_p),
                       u.view(rows, 1))
    block, length = block_tokens(full.gather(1, path), depth, nxt)
    feat = hidden.gather(1, node[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
    return (block, depth, length, torch.cat([torch.zeros_like(path[:, :1]), path], 1), feat,
            *block_out(block, length, recent, depth, length))
