"""The trunk's forward of a prepared batch (`hidden_states`, `hidden_rows`: what every trainer's loss starts from),
and an MoE model's router load-balancing loss in training, as TRL 1.16's trainers add it: `router_aux_loss_coef` (the
model config's unless given; 0 off) times the loss the model computes over each micro-batch's real tokens
(`models.moe.RouterStats`), a mean per micro-batch averaged over the micro-batches of a step and the ranks, logged as
`aux_loss`. The engine puts the weight (coef / (micro-batches x ranks)) into each batch as `router_aux_scale`;
`hidden_states` asks the model for the loss when it is there, and the trainers' losses add it here."""

from __future__ import annotations

import mlx.core as mx

from ..errors import ConfigError


def hidden_states(model, batch: dict, aux: list | None = None) -> mx.array:
    """Hidden states [B, L, D] of a prepared batch (the trunk up to the final norm); a batch without
    `attention_mask` is right-padded (`data.batches.right_padded`) and attends causally. aux: a list that
    receives an MoE model's load-balancing loss over the batch's `token_mask` when the batch carries the
    engine's `router_aux_scale` (`with_router_aux`)."""
    kw = {k: batch[k] for k in ("attention_mask", "segment_ids", "pixel_values", "image_grid_thw", "vision_meta",
                                "neftune_scale") if k in batch}
    if aux is not None and "router_aux_scale" in batch:
        kw.update(router_aux=aux, router_mask=batch.get("token_mask"))
    return model(input_ids=batch["input_ids"], return_hidden=True, **kw)


def hidden_rows(model, batch: dict, aux: list | None = None) -> mx.array:
    """Hidden states [R, D] at the scored positions `batch["rows"]` (aux: as `hidden_states`)."""
    hidden = hidden_states(model, batch, aux)
    return hidden.reshape(-1, hidden.shape[-1])[batch["rows"]]


def router_aux_coef(model, coef: float | None) -> float:
    """The weight of an MoE model's load-balancing loss in training, as TRL resolves `router_aux_loss_coef`: the
    argument, else the model config's; 0 for a model without experts (a non-zero argument for one is refused)."""
    moe = getattr(model, "moe_config", None)
    if moe is None:
        if coef:
            raise ConfigError(f"router_aux_loss_coef is {coef} but {model.config.get('model_type')} is not a "
                              "Mixture-of-Experts model: it has no router loss to weigh; leave it unset")
        return 0.0
    return float(moe.router_aux_loss_coef if coef is None else coef)


def with_router_aux(loss: mx.array, metrics: dict, aux: list, batch: dict) -> tuple[mx.array, dict]:
    """loss + the weighted load-balancing loss `aux` holds (`hidden_states`), and its value logged as aux_loss
    (TRL's metric); unchanged where the batch has no routing loss."""
    if not aux:
        return loss, metrics
    return loss + batch["router_aux_scale"] * aux[0], {**metrics, "aux_loss": mx.stop_gradient(aux[0])}
