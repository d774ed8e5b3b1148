"""Operations: the `microturn` command, `microturn up`, the keys CLI and process supervision."""
