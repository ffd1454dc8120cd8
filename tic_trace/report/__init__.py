"""The report: its one typed schema and JSON codec (`schema.Report`, built by the finder) and everything that
displays it: the terminal renderer (`terminal`), the self-contained HTML page (`html`, one module per page
section), what each renderer shows of a long report (`bounds`), the one-line texts both print (`lines`),
writing the JSON/HTML files (`files`), the listing of what a trace holds (`inspect`), and the text safety every
renderer passes trace strings through (`text`).

May import: store, graph, view.
Never compare or replay: renderers only display what the report holds.
"""
