//! A small synthetic trace in the Mooncake format, for smoke tests of the harness on any machine
//! (no real trace needed): conversations under a few shared system prompts, each turn extending
//! the previous turn's prompt, timestamps increasing.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A deterministic trace of `requests` lines (JSON objects, one per line).
pub fn synthetic_trace(requests: usize, seed: u64) -> String {
    let mut next_id = 0u64;
    let mut fresh = |n: usize| -> Vec<u64> {
        let ids = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        ids
    };
    let systems: Vec<Vec<u64>> = (0..4).map(|i| fresh(1 + i % 3)).collect();
    let mut conversations: Vec<Vec<u64>> = Vec::new();
    let mut out = String::new();
    for r in 0..requests {
        let roll = xxh3_64_with_seed(&(r as u64).to_le_bytes(), seed);
        let continue_one = !conversations.is_empty() && !roll.is_multiple_of(3);
        let ids = if continue_one {
            let c = (roll >> 8) as usize % conversations.len();
            let turn = fresh(1 + (roll >> 20) as usize % 3);
            conversations[c].extend(turn);
            conversations[c].clone()
        } else {
            let mut ids = systems[(roll >> 8) as usize % systems.len()].clone();
            ids.extend(fresh(1 + (roll >> 20) as usize % 4));
            conversations.push(ids.clone());
            ids
        };
        let list: Vec<String> = ids.iter().map(u64::to_string).collect();
        out.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}\n",
            r * 10,
            ids.len() * 512,
            1 + roll % 500,
            list.join(", ")
        ));
    }
    out
}
