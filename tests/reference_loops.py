"""Plain transcriptions of the authors' own greedy (T = 0) decoding loops: the test oracle for our adapter.

Written from the authors' public files (named in each docstring) and /work/shared/reference/real-dlm-loops.md.
Independent of spot_dlm's decoding code on purpose: only torch and transformers. One batch row, one state per
forward, no cache beyond what the authors use, and the authors' numerics: softmax in the model dtype with the mask
token left in the vocabulary, and ``torch.topk`` / ``torch.argmax`` / ``.max(-1)`` called on tensors of the same
shapes as in the authors' code, so that ties break the same way.

Each function returns (the ids after the prompt as list[int], the number of model forwards made). Every family's
loop is in this one file, longer than most, so that they read side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

NEG_INF = -torch.inf


@torch.no_grad()
def sdar_generate(
    model,
    prompt_ids: list[int],
    gen_length: int,
    block_length: int,
    steps: int,
    mask_id: int,
    stop_ids: list[int],
    threshold: float = 1.0,
) -> tuple[list[int], int]:
    """SDAR: ``block_diffusion_generate`` of the HF evaluation wrapper, JetAstra/SDAR@c2041a8,
    evaluation/opencompass/opencompass/models/huggingface_bd3.py (lines 66-272: sampling l.66-92, grid l.146-160,
    prefill l.167-182, block loop l.188-264, stop l.265-270), at T = 1, top_k = 1, top_p = 1.

    - Block grid anchored at absolute position 0, prompt included: num_blocks = ceil((P+G)/L); canvas
      [prompt | masks] of num_blocks*L tokens; position ids 0..num_blocks*L-1; a block-causal 0/1 float mask
      (``tril(ones(nb, nb))`` repeated L times on both axes).
    - Prefill: the floor(P/L)*L full prompt blocks in one pass, block-causal mask, ``store_kv=True`` (skipped if none).
      The prompt tail (P mod L tokens) opens the first decoded block and is never committed.
    - Per block, at most ``steps`` denoising passes over the block only (mask rows of the block over cache+block: all
      ones), ``store_kv=False``; once the block has no masks, a finish pass over it with ``store_kv=True`` (counted).
    - Token: top_k = 1 filtering then multinomial = argmax of the logits (first index on exact ties, where the
      authors' multinomial would pick at random). Confidence: ``softmax(logits)`` (T = 1, so no division) in the model
      dtype, before filtering, on the [L, V] reshape, gathered at the token. ``x0 = where(mask, x0, block)``.
    - Commit count ntt[i] = L // steps (the authors assert L % steps == 0), indexed by the pass number; a pass number
      beyond the schedule raises IndexError as in the authors' loop (only if the mask id itself was committed).
      threshold == 1: ``torch.topk(conf[0], ntt[i])`` (non-masked positions -inf). threshold < 1: the masked
      positions with conf > threshold if there are at least ntt[i] of them, else that topk.
    - Stop: after each finished block, stop if any stop id occurs in x[P:].
    Returns x[P : end of the last decoded block] (the authors return the whole canvas, with the undecoded masks).
    """
    if steps <= 0 or block_length % steps != 0:
        raise ValueError("the authors assert block_length % steps == 0 and block_length >= steps")
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = model.device
    L = block_length
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    P = input_ids.shape[1]
    past_key_values = DynamicCache()

    num_blocks = (P + gen_length + L - 1) // L
    total_length = num_blocks * L
    block_mask = torch.tril(torch.ones(num_blocks, num_blocks, device=device), diagonal=0)
    attn = block_mask.repeat_interleave(L, dim=0).repeat_interleave(L, dim=1).unsqueeze(0)  # [1, total, total] 0/1
    position_ids = torch.arange(0, total_length, dtype=torch.long, device=device).unsqueeze(0)  # [1, total]
    x = torch.full((1, total_length), mask_id, dtype=torch.long, device=device)  # [1, total]
    x[:, :P] = input_ids.clone()

    nfe = 0
    prefill_blocks = P // L
    prefill_length = prefill_blocks * L
    if prefill_length > 0:
        model(
            input_ids=x[:, :prefill_length],
            attention_mask=attn[:, :prefill_length, :prefill_length],
            position_ids=position_ids[:, :prefill_length],
            past_key_values=past_key_values,
            use_cache=True,
            store_kv=True,
        )
        nfe += 1

    # get_num_transfer_tokens(block_length, steps): base, the first `remainder` entries one more (remainder is 0 here)
    num_transfer_tokens = torch.zeros(steps, dtype=torch.int64) + L // steps
    num_transfer_tokens[: L % steps] += 1

    end = P
    for num_block in range(prefill_blocks, num_blocks):
        lo, hi = num_block * L, (num_block + 1) * L
        cur_x = x[:, lo:hi]  # [1, L], a view of x
        cur_attn = attn[:, lo:hi, :hi]  # [1, L, (k+1)L], all ones
        cur_pos = position_ids[:, lo:hi]  # [1, L]
        for i in range(steps + 1):
            mask_index = cur_x == mask_id  # [1, L]
            if mask_index.sum() == 0:
                model(
                    input_ids=cur_x,
                    attention_mask=cur_attn,
                    position_ids=cur_pos,
                    past_key_values=past_key_values,
                    use_cache=True,
                    store_kv=True,
                )
                nfe += 1
                break
            logits = model(
                input_ids=cur_x,
                attention_mask=cur_attn,
                position_ids=cur_pos,
                past_key_values=past_key_values,
                use_cache=True,
                store_kv=False,
            ).logits  # [1, L, V], model dtype
            nfe += 1
            flat = logits.reshape(-1, logits.shape[-1])  # [L, V]
            ori_probs = F.softmax(flat, dim=-1)  # [L, V], model dtype, unfiltered
            token = torch.argmax(flat, dim=-1, keepdim=True)  # [L, 1]
            token_prob = torch.gather(ori_probs, -1, token)  # [L, 1]
            x0 = token.view(1, L)
            x0_p = token_prob.view(1, L)
            x0 = torch.where(mask_index, x0, cur_x)
            confidence = torch.where(mask_index, x0_p, NEG_INF)  # [1, L]
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            if threshold < 1.0:
                high_conf_mask = confidence[0] > threshold  # [L]
                if high_conf_mask.sum() >= num_transfer_tokens[i]:
                    transfer_index[0] = high_conf_mask
                else:
                    _, idx = torch.topk(confidence[0], num_transfer_tokens[i])
                    transfer_index[0, idx] = True
            else:
                _, select_index = torch.topk(confidence[0], k=num_transfer_tokens[i])
                transfer_index[0, select_index] = True
            cur_x[transfer_index] = x0[transfer_index]
        x[:, lo:hi] = cur_x
        end = hi
        if any(stop_id in x[:, P:] for stop_id in stop_ids):
            break
    return x[0, P:end].tolist(), nfe


@torch.no_grad()
def llada_generate(
    model, prompt_ids: list[int], gen_length: int, block_length: int, steps: int, mask_id: int
) -> tuple[list[int], int]:
    """LLaDA: ``generate`` of ML-GSAI/LLaDA@b7e6c35, generate.py (lines 22-120), temperature 0, remasking
    'low_confidence', cfg_scale 0, logits_eos_inf and confidence_eos_eot_inf off, no attention mask.

    - Canvas [prompt | G masks], the whole canvas every pass, full attention, no cache; ``model(x,
      attention_mask=None).logits`` (no position ids). Blocks start at P. The authors assert G % L == 0 and
      steps % (G/L) == 0; steps per block = steps // num_blocks, every one of them a forward.
    - Schedule per block (get_num_transfer_tokens): M = the block's masks, M // s each, the first M % s one more.
    - x0 = argmax(logits) over the full vocabulary (mask included); confidence = softmax(logits) in the model dtype
      gathered at x0; -inf after the current block and at non-masked positions (masks left in earlier blocks stay
      eligible); ``torch.topk(confidence[0], k)`` over the [P+G] row.
    Returns x[P:] (all G positions).
    """
    if gen_length % block_length != 0:
        raise ValueError("the authors assert gen_length % block_length == 0")
    num_blocks = gen_length // block_length
    if steps % num_blocks != 0:
        raise ValueError("the authors assert steps % num_blocks == 0")
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = model.device
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    P = prompt.shape[1]
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long, device=device)  # [1, P+G]
    x[:, :P] = prompt.clone()
    steps_per_block = steps // num_blocks

    nfe = 0
    for num_block in range(num_blocks):
        lo, hi = P + num_block * block_length, P + (num_block + 1) * block_length
        block_mask_index = x[:, lo:hi] == mask_id  # [1, L]
        mask_num = block_mask_index.sum(dim=1, keepdim=True)  # [1, 1]
        num_transfer_tokens = (
            torch.zeros(1, steps_per_block, dtype=torch.int64, device=device) + mask_num // steps_per_block
        )
        num_transfer_tokens[0, : mask_num[0] % steps_per_block] += 1  # [1, s]
        for i in range(steps_per_block):
            mask_index = x == mask_id  # [1, P+G]
            logits = model(x, attention_mask=None).logits  # [1, P+G, V], model dtype
            nfe += 1
            x0 = torch.argmax(logits, dim=-1)  # [1, P+G]
            p = F.softmax(logits, dim=-1)  # model dtype
            x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)  # [1, P+G]
            x0_p[:, hi:] = NEG_INF
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, NEG_INF)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            _, select_index = torch.topk(confidence[0], k=num_transfer_tokens[0, i])
            transfer_index[0, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x[0, P:].tolist(), nfe


@torch.no_grad()
def dream_generate(
    model, prompt_ids: list[int], max_new_tokens: int, steps: int, mask_id: int, alg: str = "entropy"
) -> tuple[list[int], int]:
    """Dream: ``DreamGenerationMixin._sample`` (hub generation_utils.py, read through the copy
    NVlabs/Fast-dLLM@8292f3c dream/model/generation_utils.py: sample_tokens l.62-97, _sample l.369-497 with the
    linspace l.411, the shift l.426, the count l.476-477, the topk l.482; the count lines appear verbatim in every
    other public copy indexed) at temperature 0, top_p/top_k None, alg_temp None,
    alg 'entropy' or 'maskgit_plus', no attention mask (so ``attention_mask='full'``, position ids None).

    - Canvas: the prompt padded on the right with masks to P + max_new_tokens; exactly ``steps`` passes over the
      whole canvas, called as ``model(x, 'full', None)``; logits shifted: ``cat([logits[:, :1], logits[:, :-1]], 1)``.
    - timesteps = ``torch.linspace(1, 1e-3, steps + 1)`` (float32, on the canvas device); t = ts[i], s = ts[i+1];
      M = ``mask_index.sum() / 1`` (a float32 tensor); n = ``int(M * (1 - s / t))``, on the last pass ``int(M)``.
    - On the masked rows [M, V]: probs = softmax(logits) in the model dtype; confidence, x0 = probs.max(-1);
      entropy replaces the confidence by ``sum(probs * log(probs + 1e-10), -1)``.
    - If n > 0: ``torch.topk(full_confidence, n)`` over the whole [1, P+N] canvas (-inf at non-masked positions).
    Returns x[P:] (all max_new_tokens positions; the authors do not stop at EOS).
    """
    if alg not in ("entropy", "maskgit_plus"):
        raise ValueError(f"unsupported alg {alg!r}")
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = model.device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    P = input_ids.shape[1]
    max_length = P + max_new_tokens
    x = F.pad(input_ids, (0, max_length - P), value=mask_id)  # [1, P+N]
    timesteps = torch.linspace(1, 1e-3, steps + 1, device=x.device)  # float32

    nfe = 0
    for i in range(steps):
        mask_index = x == mask_id  # [1, P+N]
        logits = model(x, "full", None).logits  # [1, P+N, V], model dtype
        nfe += 1
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]  # [M, V]
        t = timesteps[i]
        s = timesteps[i + 1]
        probs = torch.softmax(mask_logits, dim=-1)  # [M, V], model dtype
        confidence, x0 = probs.max(dim=-1)  # [M]
        if alg == "entropy":
            log_probs = torch.log(probs + 1e-10)
            confidence = torch.sum(probs * log_probs, dim=-1)
        num_mask_token = mask_index.sum() / mask_index.shape[0]  # float32 tensor
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, NEG_INF, dtype=logits.dtype)  # [1, P+N]
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)  # [1, n]
            x_ = torch.zeros_like(x, dtype=torch.long) + mask_id
            x_[mask_index] = x0.clone()
            row_indices = torch.arange(x.size(0), device=device).unsqueeze(1).expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    return x[0, P:].tolist(), nfe


@torch.no_grad()
def fast_dllm_v2_generate(
    model,
    prompt_ids: list[int],
    gen_length: int,
    mask_id: int,
    stop_id: int,
    block_size: int = 32,
    small_block_size: int = 8,
    threshold: float = 1.0,
) -> tuple[list[int], int]:
    """Fast-dLLM v2: ``batch_sample`` (the lm-eval loop of v2/eval.py) of v2/generation_functions.py at
    NVlabs/Fast-dLLM@8292f3cd (read through the fork ydshi0/Fast-dLLM, lines 17-168), one prompt (so min_len =
    seq_len = P), temperature 0, use_block_cache off. The model's ``sample_with_top_p`` at T = 0 (hub modeling.py,
    read through Satgoy152/DualDiffusion@1aeb3d4 FastDLLM_inferencing/Fast_dLLM_v2_7B/modeling.py lines 782-789):
    p = softmax(logits) in the model dtype, token = p.argmax(-1).

    Decisions, with their source line in generation_functions.py:
    - Blocks decoded: num_blocks = max_new_tokens // B + P // B (l.33), loop from P // B (l.53, 58): exactly
      ``gen_length // B`` blocks (floor), the first one holding the prompt tail. gen_length < B runs no block and the
      authors then read an undefined ``x_t`` (l.163, NameError): refused here (ValueError).
    - Prefill only if P > B, over floor(P/B)*B tokens, ``update_past_key_values=True, block_size=B`` (l.36-37); if
      P % B == 0 the argmax of its last logits is appended as the first token of the first block (l.39-44).
      P == B: no prefill and an all-mask first block that never sees the prompt (l.36, 62): refused (ValueError).
    - Block = the prompt tail or that token, then masks (l.62-63). Sub-blocks of ``small_block_size`` strictly left
      to right; a sub-block with no masks costs no pass (l.90-99). Each pass feeds the whole block
      ``x_t[:, -B:]`` over the cache, ``update_past_key_values=False``, no ``block_size`` argument (l.111; the
      model then uses its own grid, so B must equal config.bd_size); logits shifted by one within the block and cut
      to the sub-block (l.112-113).
    - Commit (l.115-123): conf = p at the token, -inf at non-masked positions; conf > threshold (strict) plus
      ``conf.argmax(-1)`` (first index), restricted to masked positions.
    - Stop (l.125-126): only a stop id committed by that pass's rule finishes the row; the first token of a block
      (prompt tail, prefill or store-pass argmax) never does. The block is still completed (later passes as usual).
    - Block full (l.73-88): if finished, no store pass; else a store pass over the block with
      ``update_past_key_values=True, block_size=B`` whose last-position logits give the next block's first token by
      argmax, appended to x_t. This runs for the last block too, so an unfinished output ends with that extra token.
    - Output: the row of x_t (l.146 when finished, l.165 otherwise), here x_t[P:] raw: the authors' replacement of
      the tokens after the first stop id in x_t[P:] by pad_token_id (l.75-78) is not applied.
    - With P < B the first block's passes get ``past_key_values=None`` (the hub model then uses an empty cache) and
      the store pass's returned cache is used from then on (l.81-82). If such a row finishes in its first block the
      authors' cache pruning raises TypeError on ``len(None)`` (l.153) after the output is complete; here the
      output is returned.
    - A pass that commits only the mask id would make the authors loop forever: raised as RuntimeError here.
    """
    B = block_size
    P = len(prompt_ids)
    if P == 0:
        raise ValueError("empty prompt")
    if P == B:
        raise ValueError("P == block_size: the authors' loop never reads such a prompt")
    if gen_length < B:
        raise ValueError("gen_length < block_size: the authors' loop decodes no block and fails")
    if B % small_block_size != 0:
        raise ValueError("block_size must be a multiple of small_block_size")
    if getattr(model.config, "bd_size", B) != B:
        raise ValueError("block_size must equal the model's bd_size (the denoising passes do not pass block_size)")
    device = model.device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    num_blocks = gen_length // B + P // B

    nfe = 0
    if P > B:
        output = model(input_ids=input_ids[:, : P // B * B], use_cache=True, update_past_key_values=True, block_size=B)
        nfe += 1
        logits, past_key_values = output.logits, output.past_key_values
        if past_key_values is None:
            raise RuntimeError("a write pass returned no cache (the hub model creates one when given None)")
        if P % B == 0:
            next_token = logits[:, -1:, :].argmax(dim=-1)  # [1, 1]
            input_ids = torch.cat([input_ids, next_token], dim=1)
    else:
        past_key_values = None

    finished = False
    num_small_blocks = B // small_block_size
    x_t = input_ids
    for _block_idx in range(P // B, num_blocks):
        x_init = torch.full((1, B - input_ids.shape[1] % B), mask_id, dtype=torch.long, device=device)
        x_init = torch.cat([input_ids, x_init], dim=1)  # [1, (k+1)B]
        input_ids = x_init
        x_t = x_init.clone()
        while True:
            mask_idx = x_t[:, -B:] == mask_id  # [1, B]
            if mask_idx.sum() == 0:
                if finished:
                    break
                output = model(
                    input_ids=x_t[:, -B:],
                    use_cache=True,
                    past_key_values=past_key_values,
                    update_past_key_values=True,
                    block_size=B,
                )
                nfe += 1
                logits, past_key_values = output.logits, output.past_key_values
                if past_key_values is None:
                    raise RuntimeError("a write pass returned no cache (the hub model creates one when given None)")
                next_token = logits[:, -1:, :].argmax(dim=-1)  # [1, 1]
                x_t = torch.cat([x_t, next_token], dim=1)
                break
            for small_block_idx in range(num_small_blocks):
                small_block_start_idx = small_block_idx * small_block_size
                small_block_end_idx = small_block_start_idx + small_block_size
                start = -B + small_block_start_idx
                end = None if small_block_end_idx == B else -B + small_block_end_idx
                while True:
                    mask_idx = x_t[:, -B:] == mask_id  # [1, B]
                    if mask_idx[:, start:end].sum() == 0:
                        break
                    logits = model(
                        input_ids=x_t[:, -B:],
                        use_cache=True,
                        past_key_values=past_key_values,
                        update_past_key_values=False,
                    ).logits  # [1, B, V], model dtype
                    nfe += 1
                    logits = torch.cat([logits[:, :1, :], logits[:, :-1, :]], dim=1)
                    logits = logits[:, start:end]  # [1, S, V]
                    p_1t = torch.softmax(logits, dim=-1)
                    x_1 = p_1t.argmax(dim=-1)  # [1, S]
                    x1_p = torch.squeeze(torch.gather(p_1t, dim=-1, index=torch.unsqueeze(x_1, -1)), -1)  # [1, S]
                    x1_p = torch.where(mask_idx[:, start:end], x1_p, NEG_INF)
                    unmask_idx = x1_p > threshold
                    max_prob_idx = x1_p.argmax(dim=-1)  # [1]
                    unmask_idx[torch.arange(x_1.shape[0]), max_prob_idx] = True
                    unmask_idx = unmask_idx & mask_idx[:, start:end]
                    if bool((x_1[unmask_idx] == mask_id).all()):
                        raise RuntimeError("the pass committed only the mask id: the authors' loop would not end")
                    x_t[:, start:end][unmask_idx] = x_1[unmask_idx]
                    if bool(((x_1 == stop_id) & unmask_idx).any()):
                        finished = True
        input_ids = x_t
        if finished:
            break
    return x_t[0, P:].tolist(), nfe


@torch.no_grad()
def fast_dllm_v1_llada_generate(
    model, prompt_ids: list[int], gen_length: int, block_length: int, mask_id: int, threshold: float
) -> tuple[list[int], int]:
    """Fast-dLLM v1 on LLaDA: ``generate`` of NVlabs/Fast-dLLM llada/generate.py (no cache) with ``threshold``, T = 0.

    - Canvas and blocks as LLaDA's (blocks from P); every pass the whole canvas, ``model(x).logits``; the block loop
      runs until the block has no masks (no step count).
    - ``get_transfer_index``: x0 = argmax(logits); confidence = ``softmax(logits.to(float64))`` at x0; masked
      positions after the block end are excluded; ``torch.topk(confidence[0], k = masked count)`` over the canvas
      row; the first index always commits, a later one only if its confidence is not below the threshold.
    Returns x[P:] (all G positions).
    """
    P = len(prompt_ids)
    device = model.device
    x = torch.full((1, P + gen_length), mask_id, dtype=torch.long, device=device)  # [1, P+G]
    x[0, :P] = torch.tensor(prompt_ids, device=device)
    nfe = 0
    for num_block in range(gen_length // block_length):
        end = P + (num_block + 1) * block_length
        while bool((x[:, end - block_length : end] == mask_id).any()):
            nfe += 1
            mask_index = x == mask_id
            logits = model(x).logits  # [1, P+G, V]
            mask_index[:, end:] = False
            x0 = torch.argmax(logits, dim=-1)
            p = F.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, NEG_INF)
            k = int(mask_index[0].sum())
            _, select_index = torch.topk(confidence[0], k=k)
            transfer = torch.zeros_like(x, dtype=torch.bool)
            transfer[0, select_index] = True
            for rank in range(1, k):
                if confidence[0, select_index[rank]] < threshold:
                    transfer[0, select_index[rank]] = False
            x[transfer] = x0[transfer]
    return x[0, P:].tolist(), nfe
