"""The frontend half of a request's outputs: text, stop strings and the final usage.

The scheduler (the engine core) reports token ids, logprobs and the finishes it decides itself
(EOS, stop token ids, lengths, aborts); it never decodes text. A `RequestOutputProcessor` per
request turns those outputs into text once per token (`IncrementalDetokenizer`) and ends the
request at a stop string, cutting the text before it and dropping whatever the core computed
after it. It runs where the caller is: inline in `Engine.step` for offline use, and on the
event loop in `AsyncEngine.generate`, off the step thread. A request it ended early
(`stopped_early`) must be aborted in the core, which frees its KV. With logprobs it also gives
each token's own text, and each likeliest token's (`token_texts`, `top_token_texts`): every
token id is decoded once per request, here, and the HTTP responses only read them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .detokenizer import IncrementalDetokenizer, TokenDecoder
from .request import FinishReason, GenerationParams, RequestOutput


class RequestOutputProcessor:
    def __init__(self, decoder: TokenDecoder | None, prompt_ids: Sequence[int],
                 params: GenerationParams) -> None:
        self._detokenizer = IncrementalDetokenizer(decoder, prompt_ids, params.stop_strings)
        # logprobs: each token's text alone, decoded once per token id
        self._token_decoder = decoder if params.sampling.return_logprob else None
        self._token_texts: dict[int, str] = {}
        self.num_output_tokens = 0
        self.finished = False
        self.stopped_early = False  # a stop string ended it before the core did

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The output with its text; None once the request has finished here."""
        if self.finished:
            return None
        text = ""
        for i, token in enumerate(out.new_token_ids):
            piece, stop_hit = self._detokenizer.add(token)
            text += piece
            self.num_output_tokens += 1
            if stop_hit:
                self.finished = True
                self.stopped_early = not out.finished
                kept = i + 1
                return self._with_token_texts(out._replace(
                    new_token_ids=out.new_token_ids[:kept],
                    text=text + self._detokenizer.flush(),
                    finish_reason=FinishReason.STOP,
                    usage=out.usage._replace(completion_tokens=self.num_output_tokens),
                    logprobs=out.logprobs[:kept],
                    top_logprobs=out.top_logprobs[:kept],
                ))
        if out.finished:
            self.finished = True
            text += self._detokenizer.flush()
        return self._with_token_texts(out._replace(text=text))

    def _with_token_texts(self, out: RequestOutput) -> RequestOutput:
        decoder, known = self._token_decoder, self._token_texts
        if decoder is None:
            return out
        tops = out.top_logprobs
        for token_id in {*out.new_token_ids, *(t for top in tops for t, _ in top)} - known.keys():
            known[token_id] = str(decoder.decode([token_id]))
        return out._replace(token_texts=tuple(known[t] for t in out.new_token_ids),
                            top_token_texts=tuple(tuple(known[t] for t, _ in top) for top in tops))
