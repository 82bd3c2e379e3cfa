from .language_model_embedding import LanguageModelEmbedding

__all__ = ["LanguageModelEmbedding"]
