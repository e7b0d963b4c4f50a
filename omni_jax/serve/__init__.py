"""``omni-jax serve``: an OpenAI-compatible HTTP server over :class:`~omni_jax.AsyncOmniJaxPipeline`.

``protocol`` (the request schema), ``media`` (data and file URLs as prompt items), ``convert``
(a request as a prompt and per-stage params, stop strings in the text stage's), ``reply`` (one request's
pieces and end), ``fanout`` (a request's several replies, its ``n`` choices or a completion's
prompts, admitted and read as one response), ``logprobs`` (the pipeline's log-probabilities in
OpenAI's chat and legacy completion forms), ``transcripts`` (what spoken replies said, by their
audio's id, for multi-turn audio), ``responses`` (OpenAI's response JSON and SSE), ``metrics``
(Prometheus), ``app`` (the FastAPI routes), ``listen`` (the address bound before the pipeline is
built, handed to uvicorn) and ``cli`` (the command). Needs the ``serve`` extra (FastAPI,
uvicorn, prometheus-client); importing this package alone does not.
"""

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""A request body's largest size (413 beyond): room for a few base64 images and a minute of audio."""

DEFAULT_MAX_IMAGE_PIXELS = 2**25
"""The pixels a request's images may decode to together by default (about 33.5 million: an
8K frame, or eight 4K ones; the models' processors scale each image down to about 12.8 million
anyway). Decoding and preprocessing take about 13 bytes a pixel at their peak, and a compressed
image of a few kilobytes can declare hundreds of millions."""
