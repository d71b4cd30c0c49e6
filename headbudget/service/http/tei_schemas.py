"""Bodies of the routes compatible with Hugging Face text-embeddings-inference (TEI 1.9): ``POST /predict`` and
``POST /``, ``GET /info``, ``GET /health``. Field names, types and defaults follow TEI's router
(router/src/http/types.rs, router/src/lib.rs), so that TEI's clients read them unchanged."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TeiErrorType = Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty",
                       "Unauthorized", "Forbidden"]  # TEI's six, and the two its auth layer answers without a body


class PredictParameters(BaseModel):
    """The Hugging Face Inference API's options (what ``InferenceClient.text_classification`` sends)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    top_k: Annotated[int, Field(ge=1)] | None = Field(None, description="Only the k highest scores")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="Scores as probabilities (`softmax`, the default), per-label `sigmoid`, or `none` (logits)")


class PredictRequest(BaseModel):
    """TEI's PredictRequest. Unknown fields are ignored, as TEI (serde) does."""

    model_config = ConfigDict(extra="ignore", strict=True)

    inputs: str | list[str] | list[list[str]] = Field(
        description="One text (`\"...\"` or `[\"...\"]`) or a batch (`[[\"...\"], [\"...\"]]`); a pair `[a, b]` "
                    "(TEI's sentence pair) is refused: this model classifies single texts",
        examples=["Stocks rallied after the earnings report"])
    truncate: bool | None = Field(
        None, description="Cut texts over the token limit (`max_input_length` in /info); false refuses them with "
                          "422. Default: `auto_truncate` (true)")
    truncation_direction: Literal["Left", "Right", "left", "right"] = Field(
        "Right", description="Only `Right` (keep the start) is served; a text that `Left` would cut is refused")
    raw_scores: bool = Field(False, description="Logits instead of probabilities")
    parameters: PredictParameters | None = Field(
        None, description="Hugging Face Inference API options; when present, a single input is answered as a "
                          "batch of one (`[[...]]`), as that API does")


class TeiPrediction(BaseModel):
    """One label's score."""

    score: float
    label: str


PredictResponse = list[TeiPrediction] | list[list[TeiPrediction]]


class TeiError(BaseModel):
    """TEI's error body."""

    error: str
    error_type: TeiErrorType


class ClassifierModel(BaseModel):
    """The classifier's labels by index."""

    id2label: dict[str, str]
    label2id: dict[str, int]


class TeiModelType(BaseModel):
    """TEI's model_type: this server runs classifiers only."""

    classifier: ClassifierModel


class TeiInfo(BaseModel):
    """TEI's /info, with values from the loaded checkpoint and the server's limits."""

    model_id: str
    model_sha: str | None = Field(description="SHA-256 of the checkpoint weights (TEI: the Hub revision)")
    model_dtype: str = Field(description="`float32`, or `int8` for the quantized ONNX Runtime engine")
    served_model_name: str
    model_type: TeiModelType
    max_concurrent_requests: int = Field(description="Requests that may wait for the model at once")
    max_input_length: int = Field(description="Token limit per text")
    max_batch_tokens: int = Field(description="Padded tokens in one forward pass at most")
    max_batch_requests: int | None = Field(description="Texts in one forward pass at most")
    max_client_batch_size: int = Field(description="Texts per request at most")
    auto_truncate: bool = Field(description="What an absent `truncate` means")
    tokenization_workers: int
    version: str = Field(description="headbudget's version")
    sha: str | None = None
    docker_label: str | None = None
