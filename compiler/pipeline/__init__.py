"""Pipeline parallelism: stages cut at ``pipeline_boundary``, schedules, P2P and stage programs.

| module         | what it holds                                                                    |
|----------------|----------------------------------------------------------------------------------|
| ``boundary``   | ``pipeline_boundary`` (an identity custom op whose gradient is a backward cut)     |
| ``schedules``  | GPipe, 1F1B, interleaved 1F1B and ZB-H1 as per-rank action lists                  |
| ``check``      | P2P placement, the symbolic checker (inputs present, FIFO order, no deadlock), timing |
| ``stages``     | stage / microbatch / kind of every traced node; balanced cuts                     |
| ``split``      | the pipeline pass: a rank's program -> its stage program with send / recv         |
| ``plan``       | compile-side glue used by ``compiler.program``                                    |
| ``timeline``   | measured start / end of every action per rank                                     |
| ``report``     | what ``Lowered`` shows: P2P collectives, stages and balance, the schedule as SVG  |
"""
