// Which rounds an elastic job may begin: a majority of the newest round any of them knows
// (pure; ElasticRounds asks it before closing a round).
//
// Note [Never two groups]
// An elastic job's store can move (Note [Moving the store] in elastic.cpp), so a job divided by
// a network partition could count its rounds in two stores at once and train twice into one run
// folder. The rule that prevents it:
//   A round closes only when its admitted nodes hold a majority of the nodes of the newest round
//   that the store or any of those nodes knows of, not counting the nodes that left it.
// "Knows of": the store keeps its own rounds' entries; each node's entry carries the round it
// last ran and that round's node ids ("<R>/member/<i>", Note [Round store keys]), so a store
// just moved to, which keeps nothing, still learns it from the nodes that arrive. "Left": a node
// that announced leaving ("<R>/left/<id>", written by the node itself before it exits) never
// takes part in anything again, as a ddprun started again is a new node (its id).
// Why it holds. Call the round a closer counted against its round's predecessor: the rounds form
// a tree. A round trains only if every node it admitted runs it (the workers' rendezvous needs
// all their ranks), and a node runs one round at a time, each with a larger number than its
// last (it joins past its last round, and "round" only grows in a store). Suppose two rounds
// train at once, neither descending from the other; let P be their last common ancestor, and X
// and Y the children of P on the two branches. X's closer counted a majority of P's nodes less
// the ones it knew had left; those lie among P's nodes that never left (a left node joins
// nothing), so X holds more than half of those, and so does Y: some node n ran both X and Y,
// say X first. Then n's entry in Y carried X, whose number is above P's, so Y's closer counted
// against X or something newer, not P: a contradiction. So the rounds form one line, and at any
// moment at most one of them trains. The argument needs the closer to read every admitted
// node's entry: an arrival whose entry cannot be read might carry a newer round, so that round
// is abandoned and the next one tried (ElasticRounds::admissible). Two node sets reported for
// one round number mean the line was broken already (a tampered store, a ddprun of another
// version): that round does not close (a conflict).
// What it costs. A round after a loss needs a majority of the last one: a job of 2 nodes cannot
// survive losing either (the survivor cannot tell a dead peer from a cut link, and a cut link
// leaves the peer a half of its own); 3 nodes survive 1, 5 survive 2, and nodes that leave with
// SIGTERM do not count. A side without a majority never trains: it waits, and at the join
// timeout fails naming the nodes it lacks. The store's move itself needs no majority: a store
// where no round can close holds no group. Safety wins over availability, as in Raft, whose
// majorities (and whose trap, a minority of an old membership that is a majority of a new one)
// this follows: entries carry the newest membership, and a closer counts against it, not its own.
// On etcd (Note [etcd backend] in etcd.h) the rule is not applied: the rounds live in one store
// that Raft keeps consistent and that never moves, so "round" grows and a round closes once,
// by compare-and-swap, whoever asks; the nodes that reach etcd's majority form the rounds.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "round_store.h"  // KnownRound, RoundEntry

namespace ddp::launcher {

// The verdict on a round about to close over some arrivals.
struct Quorum {
  KnownRound last;                   // the newest round known: whose majority is needed
  std::vector<std::string> present;  // its nodes among the arrivals (left ones not counted)
  std::vector<std::string> missing;  // its nodes not among them and not left
  int needed = 0;                    // a majority of its nodes that have not left
  std::string conflict;              // set when two node sets were reported for one round
  bool ok() const { return conflict.empty() && static_cast<int>(present.size()) >= needed; }
};

// The newest round that `store_last` (the store's own newest closed round before the one about
// to close; none after a move) or any of `arrivals` (their entries' last rounds) knows of. Two
// different node sets for that round number set `conflict` (what they were).
KnownRound newest_round(const KnownRound& store_last, const std::vector<RoundEntry>& arrivals,
                        std::string* conflict);

// Whether `arrivals` hold a majority of `last`'s nodes, `left` (ids that announced leaving it)
// not counted.
Quorum quorum_of(const KnownRound& last, const std::vector<RoundEntry>& arrivals,
                 const std::set<std::string>& left);

}  // namespace ddp::launcher
