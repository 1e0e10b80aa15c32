"""The engine side: SGLang launcher, reference engine, router — issue 3."""
