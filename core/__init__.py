"""kvhandoff core."""
