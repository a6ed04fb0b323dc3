"""One output parser per model family (text, reasoning and tool calls); use moed.text.output_parser."""
