"""One output parser per tool-call / reasoning format (text, reasoning and tool calls); use moed.text.output_parser."""
