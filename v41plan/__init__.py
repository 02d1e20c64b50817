"""v41plan: the DeepSeek-V4.1 native paged runtime as a layout/plan compiler plus executor."""

__version__ = "0.1.0"
