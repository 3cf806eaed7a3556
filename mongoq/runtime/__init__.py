"""Run loops and lease mechanics shared by the primitives (`loop`, `keepalive`, `candidates`).
Owns no collections."""
