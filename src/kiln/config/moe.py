"""`model.moe:` a mixture of experts in place of the MLP (kiln.model.moe): Mixtral, Qwen2-MoE and Qwen3-MoE shapes."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Problem, Section


class MoEConfig(Section):
    """Each token's MLP is the weighted sum of `top_k` of `n_experts` SwiGLU experts, chosen by a linear router
    (softmax over the experts, then the top k); set by init_from for Mixtral, Qwen2-MoE and Qwen3-MoE."""

    n_experts: int = Field(8, ge=1)
    """Number of routed experts in each mixture-of-experts layer (Hugging Face's num_experts / num_local_experts)."""
    top_k: int = Field(2, ge=1)
    """Experts each token goes to (num_experts_per_tok)."""
    expert_hidden: int = Field(512, ge=1)
    """Hidden width of each expert's SwiGLU MLP (moe_intermediate_size; Mixtral's intermediate_size)."""
    norm_topk: bool = True
    """Divide the top-k router probabilities by their sum (Mixtral always; Qwen's norm_topk_prob), else use them
    as the softmax gives them."""
    shared_expert_hidden: int | None = Field(None, ge=1)
    """Width of a shared SwiGLU expert every token also goes through, scaled by sigmoid(a linear gate) (Qwen2-MoE's
    shared_expert_intermediate_size); null: none."""
    dense_layers: list[int] = []
    """Layers (from 0) with a dense MLP of model.ffn_hidden instead of experts (Qwen's mlp_only_layers and
    decoder_sparse_step)."""
    aux_loss_coef: float = Field(0.001, ge=0)
    """Weight of the load-balancing loss (Switch Transformer's, over every layer's routing, as transformers computes
    it) in the training objective (router_aux_loss_coef); logged unscaled as aux_loss. 0: not trained on."""
    z_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router z-loss (ST-MoE: the mean squared log-sum-exp of the router logits), logged as
    router_z_loss; Mixtral and Qwen have none (0)."""

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.top_k > self.n_experts:
            out.append((("top_k", "n_experts"), f"moe.top_k={self.top_k} is more than moe.n_experts={self.n_experts}"))
        if any(i < 0 for i in self.dense_layers):
            out.append((("dense_layers",), f"moe.dense_layers={self.dense_layers} holds a negative layer index"))
        return out
