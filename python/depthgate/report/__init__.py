"""Step 7, report: verdict.json, summary.md, junit.xml and report.html (a Jinja template shipped as
package data, ``report.html.j2``)."""
